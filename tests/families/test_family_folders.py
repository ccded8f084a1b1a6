"""A new architecture family costs its folder under families/ and a declaration (ARCHITECTURE "What a change costs"; README "Adding an architecture family").

The claim is checked on the tree itself: no production module outside `families/` names a family,
a parent family's folder never names its children (they extend it), every runtime family has the
tiny declaration the parity tests run, and the families package is stdlib-only data.
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from families import FAMILIES, RUNTIME_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("registry", "codegen", "runtime", "templates")   # the rooms besides families/ (generated/ is their output)


def _word(name: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")


@functools.lru_cache(maxsize=None)
def _code_text(path: Path) -> str:
    """What a file says as code: a Python module's identifiers and string literals (not its comments or
    docstrings, where naming a family documents a fact), a template's text without its comments."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return re.sub(r"\{#.*?#\}", "", text, flags=re.S)
    tree = ast.parse(text)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words.extend([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            words.extend(alias.name for alias in node.names)
    return "\n".join(words)


def _files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*")
                  if p.suffix in (".py", ".j2") and "__pycache__" not in p.parts)


def _mentions(family: str, files: list[Path]) -> list[str]:
    pattern = _word(family)
    return [str(p.relative_to(ROOT)) for p in files if pattern.search(_code_text(p))]


def test_the_scan_sees_a_family_named_in_code_and_not_in_a_comment(tmp_path):
    # The control for the tests below: they would prove nothing if the scan missed a real mention.
    module = tmp_path / "m.py"
    module.write_text('"""Reads deepseek_v3 checkpoints."""\n# glm4_moe too\nX = {"mixtral": 1}\nif family == "gpt_oss_bf16":\n    pass\n')
    assert [f for f in ("deepseek_v3", "glm4_moe", "mixtral", "gpt_oss") if _word(f).search(_code_text(module))] == ["mixtral"]
    template = tmp_path / "t.py.j2"
    template.write_text('{# qwen3_moe #}{% if family == "minimax_m2" %}{% endif %}\n')
    assert [f for f in ("qwen3_moe", "minimax_m2") if _word(f).search(_code_text(template))] == ["minimax_m2"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_production_module_outside_families_names_a_family(family):
    assert _mentions(family, _files(*PRODUCTION)) == []


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_is_named_only_by_its_folder_its_children_and_its_declarations(family):
    named_by = _mentions(family, _files("families"))
    others = sorted({Path(p).parts[1] for p in named_by} - {family})
    # Whoever else names it builds on it (imports its spec or extends its template); it never names them back.
    for child in others:
        assert _mentions(child, _files(f"families/{family}")) == [], f"{family} names {child}, which builds on it"
    assert not any(Path(p).parts[1] in ("__init__.py", "base.py") for p in named_by)
    declared = sorted(p.stem for p in (ROOT / "registry" / "models").glob("*.toml")
                      if tomllib.loads(p.read_text(encoding="utf-8"))["model"]["family"] == family)
    assert declared, f"no declaration under registry/models/ is of family {family}"


def test_the_package_lists_exactly_the_folders_and_a_runtime_family_has_its_template():
    folders = sorted(p.name for p in (ROOT / "families").iterdir() if (p / "spec.py").is_file())
    assert list(FAMILIES) == folders
    assert {name for name in folders if (ROOT / "families" / name / "modeling.py.j2").is_file()} == set(RUNTIME_FAMILIES)
    assert {"deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral", "gpt_oss", "minimax_m2", "qwen3_next", "nemotron_h"} <= set(RUNTIME_FAMILIES)


@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
def test_every_runtime_family_has_the_tiny_declaration_its_parity_test_runs(family):
    path = ROOT / "registry" / "models" / f"tiny_{family}.toml"
    assert path.is_file(), f"declare registry/models/tiny_{family}.toml (tests/generated/test_transformers_parity.py runs it)"
    assert tomllib.loads(path.read_text(encoding="utf-8"))["model"]["family"] == family


def test_the_families_package_imports_only_the_stdlib():
    # ARCHITECTURE "Rooms": families may import contract and the stdlib only (no pydantic, jinja2, torch).
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        before = set(sys.modules)
        import families
        loaded = {m.split(".")[0] for m in set(sys.modules) - before}
        print(sorted(loaded - set(sys.stdlib_module_names) - {"families", "contract"}))
        """)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""Generated model files are code a reviewer can read: every name they define is used, each opens with a short summary of what it builds and what it binds, the constants whose reason is not obvious say why, and lines stay short (ARCHITECTURE "A generated build"; issue 4 item 2)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.generated import builds

FILES = builds.modeling_files() + builds.draft_files()
IDS = [str(p.relative_to(builds.GENERATED)) for p in FILES]

# The build's identity and entry points: read by the build index, the claims check and users, not by
# the file's own code (an external drafter's DRAFT_LAYERS is its claims-checked draft table).
PUBLIC = {"MODEL", "FAMILY", "TARGET", "CHECKPOINT", "SM", "PARALLEL", "MOE_IMPLS_HONORED", "DRAFT_MOE_IMPLS_HONORED",
          "MODEL_CLASS", "DRAFT_CLASS", "DRAFT", "MODE", "DRAFT_LAYERS"}
# Constants that need their reason next to them (a comment on the line or the line above).
EXPLAINED = {"IMPLEMENTATIONS", "MOE_IMPLS_HONORED", "CPU_IMPLS", "LAYERS", "IGNORED_TENSORS", "EXPERTS_SPEC",
             "SOFTMAX_SCALE", "SLIDING_WINDOWS", "DRAFT_LAYERS", "INTERLEAVED_ROPE"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _defined(tree: ast.Module) -> dict[str, int]:
    """Module-level names (assigned, defined or imported) -> line."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update({t.id: node.lineno for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node.lineno for a in node.names})
    return names


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_every_name_a_generated_file_defines_is_used(path):
    tree = _tree(path)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    draft = path.with_name("draft.py")
    if path.name == "modeling.py" and draft.exists():  # what the draft imports from its target
        used |= {a.name for n in _tree(draft).body if isinstance(n, ast.ImportFrom) for a in n.names}
    unused = sorted(set(_defined(tree)) - used - PUBLIC)
    assert not unused, f"{path}: defines {unused} and never uses them"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_a_generated_file_opens_with_a_short_summary_of_what_it_builds(path):
    doc = ast.get_docstring(_tree(path))
    assert doc, f"{path}: no module docstring"
    lines = doc.splitlines()
    assert len(lines) <= 12 and all(len(line) <= 120 for line in lines), doc
    if path.name == "modeling.py":
        # What it builds: its layers and experts, its attention and rotary.
        assert " decoder layers, " in doc and " attention, " in doc and "rotary" in doc, doc
    if path.parent.name != "generic":
        # What it binds, per layer kind (RULES LR5's report in one line each).
        assert "MoE routed layers " in doc or "MoE draft layers " in doc, doc


def _commented(source: list[str], line: int) -> bool:
    """A comment on the line, or above it within its paragraph (a commented group of constants)."""
    if "#" in source[line - 1]:
        return True
    for above in reversed(source[: line - 1]):
        if not above.strip():
            return False
        if above.lstrip().startswith("#"):
            return True
    return False


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_constants_whose_reason_is_not_obvious_carry_a_comment(path):
    source = path.read_text(encoding="utf-8").splitlines()
    assigned = {t.id: n.lineno for n in _tree(path).body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    missing = [f"{name} (line {line})" for name, line in assigned.items() if name in EXPLAINED and not _commented(source, line)]
    assert not missing, f"{path}: no comment saying why for {', '.join(missing)}"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_lines_stay_readable(path):
    long = [(i, len(l)) for i, l in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(l) > 140]
    assert not long, f"{path}: lines longer than 140 characters: {long}"


def test_a_build_says_where_its_experts_dequantize_and_whether_they_ever_ran_on_its_sm():
    # issue 15 items 4-5: the kimi_k3 sm_100 build runs TORCH W4A16, which keeps MXFP4 packed and has
    # never run on sm_100; its docstring and resolution.json say both.
    import json

    folder = builds.GENERATED / "kimi_k3" / "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4"
    doc = ast.get_docstring(_tree(folder / "modeling.py")).splitlines()
    assert doc[-4:] == [
        "MoE routed layers 1-92 (w4a16_mxfp4): torch.grouped_mm.grouped_gemm.w4a16_mxfp4 (TORCH, preferred).",
        "  Weights kept packed, dequantized per expert group in the forward; runs on sm_100: unverified (never run on that SM).",
        "MoE draft layers 1 (bf16): torch.grouped_mm.grouped_gemm.bf16 (TORCH, preferred).",   # its external drafter
        "  Weights unquantized, used as loaded; runs on sm_100: unverified (never run on that SM).",
    ]
    layer, _drafter = json.loads((folder / "resolution.json").read_text(encoding="utf-8"))["layers"]
    assert (layer["weights"], layer["verification"]) == (
        "kept packed, dequantized per expert group in the forward", "runs on sm_100: unverified (never run on that SM)")
    cupy = ast.get_docstring(_tree(builds.GENERATED / "gpt_oss_120b" / "gpt_oss_120b_mxfp4__sm_90__tp1" / "modeling.py"))
    assert cupy.endswith("\n  Weights kept quantized, decoded in registers by the GEMM kernel; runs on sm_90: verified "
                         "(tests passed there).")

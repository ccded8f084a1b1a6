"""No string from a declaration is ever pasted into code (ARCHITECTURE "Names"; RULES GN1, GN4).

Names that reach identifiers, paths or module names are refused when the declaration loads; every
other string (docs, config values, quant metadata patterns, profile names) reaches generated code only
as a Python literal, so the generated files parse, contain no statement the declaration wrote, and
give the value back verbatim.
"""

from __future__ import annotations

import ast
import math

import pytest

from codegen.render import py
from tests.codegen.helpers import MYMOE, cli, write_models

PAYLOAD = "x'''\"\"\"\\\n); import os; os.system('echo pwned') #"
TOML_PAYLOAD = PAYLOAD.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
TOKEN_RULE = "String should match pattern '^[a-z][a-z0-9_]*$'"


def line(text, fragment):
    return text[: text.index(fragment)].count("\n") + 1


def refused(capsys, tmp_path, text):
    folder = write_models(tmp_path / "models", mymoe=text)
    code, out, err = cli(capsys, "generate", "--models", folder, "--model", "mymoe", "--out", tmp_path / "out")
    assert (code, out) == (2, "") and not (tmp_path / "out").exists()
    return err.removeprefix(f"error: {folder}/mymoe.toml:")


def generated_python(capsys, tmp_path, text) -> dict[str, str]:
    folder = write_models(tmp_path / "models", mymoe=text)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "generate", "--models", folder, "--model", "mymoe", "--out", out)
    assert (code, err) == (0, "")
    return {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*.py")}


def assert_nothing_injected(sources: dict[str, str]) -> None:
    """Every file parses; no import of os and no call of system anywhere."""
    for path, text in sources.items():
        tree = ast.parse(text, path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "os" for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "os", path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr != "system", path


def facts_of(sources: dict[str, str]) -> dict:
    namespace: dict = {}
    exec(compile(sources["mymoe/facts.py"], "facts.py", "exec"), namespace)  # constants only: no imports
    return namespace


def test_a_model_name_that_would_inject_code_is_refused_when_the_declaration_loads(capsys, tmp_path):
    # ARCHITECTURE "Names": every name that reaches code is an identifier-safe token
    text = MYMOE.replace('name = "mymoe"\n', f'name = "{TOML_PAYLOAD}"\n', 1)
    assert refused(capsys, tmp_path, text) == f"{line(text, 'name = ')}: model.name: {TOKEN_RULE}\n"


def test_a_checkpoint_name_that_would_inject_code_is_refused(capsys, tmp_path):
    text = MYMOE.replace('name = "mymoe_bf16"', 'name = "mymoe_bf16\\"); import os #"')
    at = line(text, 'name = "mymoe_bf16')
    assert refused(capsys, tmp_path, text) == f"{at}: checkpoints[0].name: {TOKEN_RULE}\n"


def test_a_parallel_layout_name_that_would_inject_code_is_refused(capsys, tmp_path):
    text = MYMOE.replace('parallel = "tp1"', 'parallel = "tp1; import os"', 1)
    assert refused(capsys, tmp_path, text) == f"{line(text, 'parallel = ')}: targets[0].parallel: {TOKEN_RULE}\n"


def test_doc_strings_with_quotes_and_newlines_never_reach_code_unquoted(capsys, tmp_path):
    text = (
        MYMOE.replace('doc = "A user\'s own model."', f'doc = "{TOML_PAYLOAD}"')
        .replace('name = "mymoe_bf16"\n', f'name = "mymoe_bf16"\ndoc = "{TOML_PAYLOAD}"\n', 1)
        .replace('moe_impls_honored = "*"', f'moe_impls_honored = "*"\ndoc = "{TOML_PAYLOAD}"')
    )
    assert_nothing_injected(generated_python(capsys, tmp_path, text))


def test_config_keys_the_family_does_not_read_never_reach_generated_code(capsys, tmp_path):
    # RULES GN4: HF configs carry many keys; only the family's typed keys are passed on
    text = MYMOE.replace("num_key_value_heads = 2\n", f'num_key_value_heads = 2\nnote = "{TOML_PAYLOAD}"\nlabels = ["{TOML_PAYLOAD}"]\n')
    sources = generated_python(capsys, tmp_path, text)
    assert_nothing_injected(sources)
    assert not [path for path, source in sources.items() if "pwned" in source]
    assert set(facts_of(sources)["CONFIG"]) == {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_local_experts", "num_experts_per_tok", "num_attention_heads", "num_key_value_heads"}


def test_quant_patterns_and_profile_names_are_rendered_as_literals(capsys, tmp_path):
    # RULES GN4: rendered Python is parsed; the values come back verbatim
    text = MYMOE.replace('name = "mymoe_bf16"\n', f'name = "mymoe_bf16"\nexclude_modules = ["{TOML_PAYLOAD}"]\n', 1)
    text += f'\n[parallel_profiles."{TOML_PAYLOAD}"]\ntp = 1\nmoe_tp = 1\nep = 1\n'
    sources = generated_python(capsys, tmp_path, text)
    assert_nothing_injected(sources)
    facts = facts_of(sources)
    assert facts["QUANT"]["mymoe_bf16"]["exclude_modules"] == [PAYLOAD]
    assert facts["PROFILES"] == {PAYLOAD: [1, 1, 1, 1]}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_config_number_is_refused_when_the_declaration_loads(capsys, tmp_path, value):
    # (Fixed: `nan` rendered as a bare name, which parses and fails with NameError on import.)
    text = MYMOE.replace("num_key_value_heads = 2\n", f"num_key_value_heads = 2\nrms_norm_eps = {value}\n")
    assert refused(capsys, tmp_path, text) == f"{line(text, 'rms_norm_eps')}: config.rms_norm_eps: Input should be a finite number\n"


@pytest.mark.parametrize("value, check", [(math.nan, math.isnan), (math.inf, lambda v: v == math.inf), (-math.inf, lambda v: v == -math.inf)])
def test_the_literal_filter_spells_non_finite_floats_as_expressions_that_evaluate_back(value, check):
    # Defence in depth behind the typed config: `repr(nan)` is a bare name, which would not evaluate back.
    assert check(eval(py(value), {"__builtins__": {"float": float}}))


def test_a_value_that_passed_validation_still_cannot_end_its_docstring_or_header_comment():
    # Defence in depth (RULES GN4): what reaches a docstring goes through `doc`, a header line escapes line breaks.
    from codegen.render import render_python
    from codegen.verify import DATA_CLAIMS, verify_python

    text = render_python("package_init.py.j2", "m/__init__.py", "generate --models 'dir\nimport os'", "sha256:0",
                         "What\r\nexec('x')", docstring=PAYLOAD + '"')
    verify_python("m/__init__.py", text, DATA_CLAIMS)
    tree = ast.parse(text)
    assert [type(node).__name__ for node in tree.body] == ["Expr"]
    assert ast.get_docstring(tree, clean=False) == PAYLOAD + '"'
    assert text.splitlines()[1:4] == ["# Regenerate: generate --models 'dir\\nimport os'", "# Fingerprint: sha256:0", "# What\\r\\nexec('x')"]

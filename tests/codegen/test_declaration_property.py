"""Any declaration value either generates builds that pass the allow-list and import harmlessly, or is refused with one line (RULES GN4).

Hypothesis drives values of every kind (wrong types, strings with quotes, newlines and triple quotes
that try to run code, huge, negative and non-finite numbers, unicode, lists, nested tables) into the
[config] of a small user model, and runs the real `generate --models DIR --out TMP` path (the CLI's
main) on it. Each case exits 0, and then every generated Python file passes its claims and imports
without the payloads' sentinel file appearing; or it exits 2 with one `error:` line and writes
nothing. In neither case does anything appear outside `--out`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from codegen.cli import main
from codegen.generate import declared_plans
from codegen.verify import verify_tree
from registry.declarations import load_models
from registry.impls import load_registry
from tests.codegen.helpers import MYMOE, files

SENTINEL = "PWNED"
# What a payload runs if it ever reaches code: it creates SENTINEL in the working folder.
_CODE = f"open({SENTINEL!r}, 'w'); __import__('os').system('touch {SENTINEL}')"
PAYLOADS = [f'4 """\n{_CODE}\n"""', f"x'''\n{_CODE}\n'''", f"\\\n{_CODE} #", f'"); {_CODE}; ("', f"\r\n{_CODE}\r\n"]

READ = ["num_attention_heads", "num_key_value_heads", "hidden_size", "num_local_experts", "num_experts_per_tok",
        "num_hidden_layers", "head_dim", "rms_norm_eps", "rope_theta", "sliding_window", "rope_scaling", "hidden_act",
        "architectures", "tie_word_embeddings", "max_position_embeddings"]
UNREAD = ["initializer_range", "note", "router", PAYLOADS[0]]   # keys mixtral does not read: accepted, dropped
keys = st.one_of(st.sampled_from(READ), st.sampled_from(UNREAD))

text = st.one_of(st.sampled_from(PAYLOADS), st.text(st.characters(exclude_categories=["Cs"]), max_size=30))
numbers = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=1, max_value=8),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e-6, 1e308]),
)
scalars = st.one_of(numbers, st.booleans(), text)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["type", "rope_type", "factor", "x", PAYLOADS[0]]), inner, max_size=3),
), max_leaves=6)


def toml_value(value) -> str:
    """A TOML literal of a value the strategies make (json strings are TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{ " + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items()) + " }"


def declaration(changes: dict) -> str:
    lines = MYMOE.splitlines()
    config = [line for line in lines[lines.index("[config]") + 1: lines.index("[[checkpoints]]")] if line.split(" = ")[0] not in changes]
    head, tail = lines[: lines.index("[config]") + 1], lines[lines.index("[[checkpoints]]") - 1:]
    return "\n".join(head + config[:-1] + [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in changes.items()] + tail) + "\n"


def generate(models: Path, out: Path) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["generate", "--models", str(models), "--model", "mymoe", "--out", str(out)])
    return code, stdout.getvalue(), stderr.getvalue()


def import_everything(out: Path, package: str) -> None:
    """Import every generated module of the build as the package `package` (its folder on sys.path)."""
    sys.path.insert(0, str(out.parent))
    try:
        for path in sorted(out.rglob("*.py")):
            parts = path.relative_to(out).with_suffix("").parts
            importlib.import_module(".".join((package,) + tuple(p for p in parts if p != "__init__")))
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


_COUNTER = iter(range(10**9))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(keys, values, min_size=1, max_size=2))
def test_any_config_value_generates_harmless_builds_or_is_refused_in_one_line(changes):
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        root = Path(scratch)
        models = root / "models"
        models.mkdir()
        (models / "mymoe.toml").write_text(declaration(changes), encoding="utf-8")
        package = f"prop_build_{next(_COUNTER)}"
        out = root / package
        before = files(models)
        code, stdout, stderr = generate(models, out)
        assert code in (0, 2), (code, stderr)
        event(f"exit {code}")
        if code == 2:
            assert stdout == "" and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
            assert not out.exists()
        else:
            decls = load_models(models)
            plans = declared_plans({"mymoe": decls["mymoe"]})
            checked = verify_tree(out, [p.plan for _, ts in plans.values() for p in ts], load_registry())
            assert checked == sorted(p.relative_to(out).as_posix() for p in out.rglob("*.py"))
            import_everything(out, package)
        assert not (root / SENTINEL).exists()
        # Nothing outside --out: the scratch folder holds the models (unchanged) and the output only.
        assert sorted(p.name for p in root.iterdir()) == sorted(["models"] + ([package] if code == 0 else []))
        assert files(models) == before


@pytest.mark.parametrize("payload", PAYLOADS)
def test_every_payload_in_a_number_key_is_refused_and_in_an_unread_key_never_reaches_code(payload, tmp_path, monkeypatch):
    # The examples hypothesis may not draw, each time: a payload where an integer belongs, and one the family does not read.
    monkeypatch.chdir(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    text = declaration({"num_attention_heads": payload})
    (models / "mymoe.toml").write_text(text, encoding="utf-8")
    at = text[: text.index('"num_attention_heads" = ')].count("\n") + 1
    code, _, stderr = generate(models, tmp_path / "out")
    assert code == 2 and stderr.startswith(f"error: {models}/mymoe.toml:{at}: config.num_attention_heads: Input should be a valid integer, not a string ")
    assert stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    (models / "mymoe.toml").write_text(declaration({"note": payload}), encoding="utf-8")
    code, _, stderr = generate(models, tmp_path / "prop_payload_build")
    assert (code, stderr) == (0, "")
    assert not [p for p in (tmp_path / "prop_payload_build").rglob("*.py") if SENTINEL in p.read_text()]
    import_everything(tmp_path / "prop_payload_build", "prop_payload_build")
    assert not (tmp_path / SENTINEL).exists()

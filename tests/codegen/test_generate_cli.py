"""`python -m codegen generate` as a user meets it: refusal and fallback, --out, --dry-run (RULES TG5).

A target that does not honor the selection is refused; under `auto` the command says which target
refused and why, writes the model's generic build instead (under build/generated unless --out) and
exits 0; under `require` it exits 2 with the same facts and writes nothing.
"""

from __future__ import annotations

from codegen.generate import EXPLORE_ROOT
from codegen.outputs import index_outputs
from registry.declarations import find_model, load_models, resolve_target
from registry.layer_task import span
from registry.selection import Selection
from tests.codegen.helpers import EAGER_BF16, GROUPED_BF16, MYMOE, cli, files, snapshot, write_models

TAIL = "Use --mode require (MODE=require) to make this an error."
INDEX_FILES = sorted(o.path for o in index_outputs([], []))


def kimi_refusals(tactic: str = "torch.eager"):
    """The refusal line of each kimi_k3 sm_100 target, from its declaration and the resolution."""
    decl = find_model("kimi_k3", load_models())
    lines = []
    for target in (t for t in decl.targets if t.sm == 100):
        routed = next(r for r in resolve_target(decl, target, Selection(tactic=tactic)).reports if r.role == "target")
        lines.append(
            f"{target.name}: refused: moe_config.tactic {tactic!r} resolves to {routed.winner} for the routed layers "
            f"{span(routed.layers)} (format {routed.run_format} on sm_100); this target honors only "
            f"{', '.join(sorted(target.moe_impls_honored))} (RULES TG3)"
        )
    return lines


def test_a_tactic_kimi_k3_does_not_honor_falls_back_to_the_generic_build_under_auto(capsys, tmp_path):
    # RULES TG5 (issue 4 "Done when": MODE=auto falls back)
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "generate", "--model", "kimi_k3", "--sm", "100", "--tactic", "torch.eager", "--out", out)
    assert (code, err) == (0, "")
    refusals = kimi_refusals()
    expected = []
    for line in refusals:
        expected += [line, f"  -> generic build: {out}/kimi_k3/generic (resolves each layer when it loads)"]
    expected.append(f"{len(refusals)} targets refused, generic build written. {TAIL}")
    lines = stdout.splitlines()
    assert lines[: len(expected)] == expected
    written = ["kimi_k3/__init__.py", "kimi_k3/facts.py", "kimi_k3/generic/__init__.py", "kimi_k3/generic/modeling.py"]
    assert sorted(files(out)) == sorted(written + INDEX_FILES)   # the generic build, no specialized one
    generic = (out / "kimi_k3/generic/modeling.py").read_text()
    assert generic.splitlines()[1] == "# Regenerate: python -m codegen generate --model kimi_k3 --tactic torch.eager"


def test_without_out_the_fallback_goes_to_build_generated_and_generated_is_untouched(capsys, repo):
    # RULES TG5; ARCHITECTURE: an exploration never writes generated/
    declared = snapshot(repo / "generated")
    code, stdout, _ = cli(capsys, "generate", "--model", "kimi_k3", "--sm", "100", "--tactic", "torch.eager")
    assert code == 0
    assert f"  -> generic build: {EXPLORE_ROOT}/kimi_k3/generic (resolves each layer when it loads)" in stdout.splitlines()
    assert (repo / EXPLORE_ROOT / "kimi_k3/generic/modeling.py").is_file()
    assert snapshot(repo / "generated") == declared


def test_under_require_a_refusal_exits_2_with_the_same_facts_and_writes_nothing(capsys, repo):
    # RULES TG5 (issue 4 "Done when": MODE=require exits 2)
    before = snapshot(repo)
    code, stdout, err = cli(capsys, "generate", "--model", "kimi_k3", "--sm", "100", "--tactic", "torch.eager", "--mode", "require")
    assert (code, stdout) == (2, "")
    assert err == "error: " + "\n".join(kimi_refusals()) + "\n--mode require: nothing written (RULES TG5)\n"
    assert snapshot(repo) == before and not (repo / "build").exists()


def test_a_users_model_refusal_and_exploration_messages_read_exactly(capsys, tmp_path):
    # RULES TG5, TG3: tp1 honors only the grouped GEMM and refuses; tp2 honors any id and is explored
    models = write_models(tmp_path / "models", mymoe=MYMOE)
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "generate", "--models", models, "--model", "mymoe", "--tactic", "Eager", "--out", out)
    assert (code, err) == (0, "")
    lines = stdout.splitlines()
    assert lines[:4] == [
        f"mymoe_bf16__sm_90__tp1: refused: moe_config.tactic 'eager' resolves to {EAGER_BF16} for the routed layers 0-1 "
        f"(format bf16 on sm_90); this target honors only {GROUPED_BF16} (RULES TG3)",
        f"  -> generic build: {out}/mymoe/generic (resolves each layer when it loads)",
        f"1 target refused, generic build written. {TAIL}",
        f"mymoe_bf16__sm_90__tp2: written to {out}/mymoe/mymoe_bf16__sm_90__tp2",
    ]
    build = ["__init__.py", "modeling.py", "resolution.json"]
    expected = ["mymoe/__init__.py", "mymoe/facts.py", "mymoe/generic/__init__.py", "mymoe/generic/modeling.py"]
    expected += [f"mymoe/mymoe_bf16__sm_90__tp2/{f}" for f in build] + INDEX_FILES
    assert sorted(l.removeprefix(f"wrote {out}/") for l in lines[4:-1]) == sorted(expected)
    assert lines[-1] == f"{len(expected)} files written, 0 unchanged"
    modeling = (out / "mymoe/mymoe_bf16__sm_90__tp2/modeling.py").read_text()
    assert f"IMPLEMENTATIONS = {{\n    {EAGER_BF16!r}: (TorchEagerBf16Experts, 'VANILLA'),\n}}" in modeling


def test_under_require_a_users_model_fails_even_when_another_target_claims(capsys, tmp_path):
    # RULES TG5: require names the tactic, the target and the ids it does not honor
    models = write_models(tmp_path / "models", mymoe=MYMOE)
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "generate", "--models", models, "--model", "mymoe", "--tactic", "eager", "--mode", "require", "--out", out)
    assert (code, stdout) == (2, "")
    assert err == (
        f"error: mymoe_bf16__sm_90__tp1: refused: moe_config.tactic 'eager' resolves to {EAGER_BF16} for the routed "
        f"layers 0-1 (format bf16 on sm_90); this target honors only {GROUPED_BF16} (RULES TG3)\n"
        "--mode require: nothing written (RULES TG5)\n"
    )
    assert not out.exists()


def test_a_users_model_is_an_exploration_even_with_its_declared_selection(capsys, repo, tmp_path):
    # ARCHITECTURE: generated/ holds exactly what registry/ declares; a --models declaration goes to build/generated
    models = write_models(tmp_path / "models", mymoe=MYMOE)
    declared = snapshot(repo / "generated")
    code, stdout, _ = cli(capsys, "generate", "--models", models, "--model", "mymoe", "--sm", "90", "--parallel", "tp1")
    assert code == 0
    assert stdout.splitlines()[0] == f"mymoe_bf16__sm_90__tp1: written to {EXPLORE_ROOT}/mymoe/mymoe_bf16__sm_90__tp1"
    assert (repo / EXPLORE_ROOT / "mymoe/mymoe_bf16__sm_90__tp1/modeling.py").is_file()
    assert snapshot(repo / "generated") == declared


def test_dry_run_says_what_would_change_and_writes_nothing(capsys, repo):
    # codegen_anchors §9.6: a list-outputs mode
    before = snapshot(repo)
    code, stdout, _ = cli(capsys, "generate", "--model", "kimi_k3", "--sm", "100", "--tactic", "torch.eager", "--dry-run")
    assert code == 0
    lines = stdout.splitlines()
    assert f"2 targets refused, generic build would be written. {TAIL}" in lines
    assert f"would write {EXPLORE_ROOT}/kimi_k3/generic/modeling.py" in lines
    assert snapshot(repo) == before and not (repo / "build").exists()


def test_regenerating_a_declared_model_rewrites_nothing_on_a_current_tree(capsys, repo):
    # issue 4 "Done when": make generate MODEL=kimi_k3 SM=100 regenerates with no diff
    before = snapshot(repo)
    code, stdout, err = cli(capsys, "generate", "--model", "kimi_k3", "--sm", "100")
    assert (code, err) == (0, "")
    assert stdout.splitlines()[-1].startswith("0 files written, ")
    assert snapshot(repo) == before


def test_an_sm_with_no_declared_target_is_refused_naming_the_targets(capsys, tmp_path):
    # RULES TG1: generate builds declared targets; explain narrates the rest
    models = write_models(tmp_path / "models", mymoe=MYMOE)
    code, stdout, err = cli(capsys, "generate", "--models", models, "--model", "mymoe", "--sm", "100", "--out", tmp_path / "o")
    assert (code, stdout) == (2, "")
    assert err == "error: mymoe declares no target on sm_100; its targets: mymoe_bf16__sm_90__tp1, mymoe_bf16__sm_90__tp2\n"


def test_generate_without_model_or_all_is_refused(capsys):
    code, stdout, err = cli(capsys, "generate")
    assert (code, stdout, err) == (2, "", "error: generate needs --model M (or --all)\n")


def test_generate_all_refuses_selection_flags_instead_of_ignoring_them(capsys):
    # RULES TG5: --all writes declared selections; a flag it would drop silently is an error
    code, stdout, err = cli(capsys, "generate", "--all", "--sm", "100", "--tactic", "eager")
    assert (code, stdout) == (2, "")
    assert err == (
        "error: generate --all writes every declared build with its declared selection; drop --sm, --tactic "
        "(or use --model M to explore a selection)\n"
    )


def test_a_relative_out_is_relative_to_the_working_directory(capsys, tmp_path, monkeypatch):
    # (Fixed: a relative --out was resolved against the repo root, wherever the command ran.)
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = cli(capsys, "generate", "--model", "tiny_mixtral", "--out", "mine")
    assert code == 0
    assert (tmp_path / "mine/tiny_mixtral/generic/modeling.py").is_file()


def test_a_declared_target_that_does_not_claim_its_own_selection_is_a_declaration_error(capsys, tmp_path):
    # RULES TG4: generation never binds an id the target does not honor; the declaration must change
    text = MYMOE.replace('moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]',
                         'moe_impls_honored = ["torch.grouped_mm.grouped_gemm.bf16"]\nselection = { tactic = "eager" }')
    models = write_models(tmp_path / "models", mymoe=text)
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "generate", "--all", "--models", models, "--out", out)
    assert (code, stdout) == (2, "")
    assert err == (
        "error: mymoe: targets[0]: target mymoe_bf16__sm_90__tp1 does not claim its own declared selection: "
        f"moe_config.tactic 'eager' resolves to {EAGER_BF16} for the routed layers 0-1 (format bf16 on sm_90); "
        f"this target honors only {GROUPED_BF16} (RULES TG3); add what it should bind to moe_impls_honored "
        "(or draft_moe_impls_honored), or declare a selection it honors\n"
    )
    assert not out.exists()

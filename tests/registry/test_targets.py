"""Targets and honored ids (RULES TG1-TG4) on the kimi_k3, glm_5_2 and minimax_m3 declarations."""

from __future__ import annotations

import re

import pytest

from contract import Honored
from registry.declarations import deployment_for, load_declaration, matching_targets, resolve_target
from registry.errors import DeclarationError
from registry.model_resolve import resolve_model
from registry.selection import Selection
from tests.registry.helpers import facts, project_models, site, write

KIMI_ID = "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"


def decl(name):
    return project_models()[name]


def target(name, target_name):
    d = decl(name)
    return d, next(t for t in d.targets if t.name == target_name)


def resolve(name, target_name, selection):
    d, t = target(name, target_name)
    return resolve_target(d, t, selection)


# --- TG1: a target is (checkpoint, SM, parallel layout), named from them ------------------------------


def test_targets_are_named_checkpoint_sm_parallel():
    # RULES TG1
    assert [t.name for t in decl("kimi_k3").targets] == [
        "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4",
        "kimi_k3_mxfp4__sm_100__tp16_moetp16ep1",
    ]
    assert [t.name for t in decl("glm_5_2").targets] == [
        "glm_5_2_nvfp4__sm_107__low_latency", "glm_5_2_nvfp4_fp8mtp__sm_107__low_latency"]
    assert [t.name for t in decl("minimax_m3").targets] == [
        "minimax_m3_nvfp4__sm_103__tp4",
        "minimax_m3_nvfp4__sm_103__tp8",
        "minimax_m3_nvfp4__sm_107__tp2",
        "minimax_m3_nvfp4__sm_107__tp4",
        "minimax_m3_nvfp4__sm_107__tp8",
    ]
    for d in project_models().values():
        for t in d.targets:
            assert re.fullmatch(r"[a-z][a-z0-9_]*__sm_\d+__[a-z][a-z0-9_]*", t.name)


def test_the_parallel_layout_is_part_of_the_target_and_sets_the_moe_split():
    # RULES TG1
    d, t = target("kimi_k3", "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4")
    assert (deployment_for(d, t).moe_tp, deployment_for(d, t).ep, deployment_for(d, t).sm) == (4, 4, 100)
    d, t = target("glm_5_2", "glm_5_2_nvfp4__sm_107__low_latency")
    assert (deployment_for(d, t).moe_tp, deployment_for(d, t).ep) == (4, 1)  # the declared profile
    assert [t.parallel for t in matching_targets(decl("minimax_m3"), sm=107)] == ["tp2", "tp4", "tp8"]


# --- TG2: what targets declare ------------------------------------------------------------------------


def test_kimi_k3_targets_each_honor_exactly_one_id_and_any_draft_id():
    # RULES TG2 (scenario kimi_k3)
    for t in decl("kimi_k3").targets:
        assert t.honored() == Honored(frozenset({KIMI_ID}))
        assert t.honored(draft=True) == Honored(wildcard=True)


def test_glm_5_2_honors_one_id_and_declares_no_draft_ids():
    # RULES TG2 (scenario glm_5_2)
    # Both: the NVFP4 checkpoint's and the mixed (FP8-block MTP) checkpoint's.
    for t in decl("glm_5_2").targets:
        assert t.honored() == Honored(frozenset({"torch.eager.loop.nvfp4"}))
        assert t.honored(draft=True) == Honored() and not t.honored(draft=True).declared


def test_minimax_m3_targets_honor_any_draft_id():
    # RULES TG2 (scenario minimax_m3)
    assert {t.honored(draft=True) for t in decl("minimax_m3").targets} == {Honored(wildcard=True)}


TARGET_DECL = """\
[model]
name = "{name}"
family = "mixtral"
doc = "A test model."

[config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_local_experts = 4
num_experts_per_tok = 2

[[checkpoints]]
name = "{name}_bf16"

[[targets]]
checkpoint = "{name}_bf16"
sm = {sm}
parallel = "tp1"
moe_impls_honored = [
    "torch.grouped_mm.grouped_gemm.bf16",
    "{second}",
]
"""


def test_an_unknown_honored_id_makes_the_declaration_invalid_with_file_line_and_field(tmp_path):
    # RULES TG2
    path = write(tmp_path / "m.toml", TARGET_DECL.format(name="m", sm=90, second="cutlass.mma.grouped_gemm.bf16"))
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value) == (
        f"{path}:21: targets[0].moe_impls_honored: 'cutlass.mma.grouped_gemm.bf16' is not a registered implementation "
        "id; see `python -m codegen catalog` (RULES TG2)"
    )


def test_an_honored_id_not_eligible_on_the_target_sm_makes_the_declaration_invalid(tmp_path):
    # RULES TG2: the TORCH kernels do not run on sm_80.
    text = TARGET_DECL.format(name="m", sm=80, second="torch.eager.loop.bf16")
    path = write(tmp_path / "m.toml", text)
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value) == (
        f"{path}:21: targets[0].moe_impls_honored: torch.grouped_mm.grouped_gemm.bf16 is not eligible on sm_80 for "
        "any of this target's layer formats (bf16); list an implementation that can serve them (RULES TG2)"
    )


def test_an_honored_id_of_a_format_no_layer_runs_makes_the_declaration_invalid(tmp_path):
    # RULES TG2
    path = write(tmp_path / "m.toml", TARGET_DECL.format(name="m", sm=90, second="torch.eager.loop.nvfp4"))
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value) == (
        f"{path}:21: targets[0].moe_impls_honored: torch.eager.loop.nvfp4 is not eligible on sm_90 for any of this "
        "target's layer formats (bf16); list an implementation that can serve them (RULES TG2)"
    )


def test_a_draft_honored_id_is_checked_against_the_draft_formats(tmp_path):
    # RULES TG2
    text = TARGET_DECL.format(name="m", sm=90, second="torch.eager.loop.bf16") + 'draft_moe_impls_honored = ["torch.eager.loop.bf16"]\n'
    path = write(tmp_path / "m.toml", text)
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value) == (
        f"{path}:25: targets[0].draft_moe_impls_honored: torch.eager.loop.bf16 is not eligible on sm_90 for any of "
        "this target's draft layer formats (none); list an implementation that can serve them (RULES TG2)"
    )


def test_an_honored_value_of_the_wrong_shape_is_invalid(tmp_path):
    # RULES TG2: a list of ids, "*", or nothing.
    text = TARGET_DECL.format(name="m", sm=90, second="torch.eager.loop.bf16").replace(
        'moe_impls_honored = [\n    "torch.grouped_mm.grouped_gemm.bf16",\n    "torch.eager.loop.bf16",\n]', 'moe_impls_honored = "all"'
    )
    path = write(tmp_path / "m.toml", text)
    with pytest.raises(DeclarationError) as info:
        load_declaration(path)
    assert str(info.value) == (
        f"{path}:21: targets[0].moe_impls_honored: 'all' is not a list of implementation ids, \"*\" (any) or left "
        "out (honors none) (RULES TG2)"
    )


def test_an_mxfp4_target_may_honor_any_of_the_sms_mxfp4_run_formats():
    # RULES TG2: kimi_k3 honors w4a16_mxfp4, one of sm_100's MXFP4 run formats, and loads.
    assert KIMI_ID in decl("kimi_k3").targets[0].moe_impls_honored


# --- TG3: a tactic is honored when everything it can resolve to is honored ---------------------------


def test_kimi_k3_targets_honor_a_tactic_that_resolves_to_their_one_id():
    # RULES TG3
    for t in decl("kimi_k3").targets:
        for tactic in ("grouped_mm", "grouped_mm.w4a16_mxfp4", KIMI_ID):
            resolution = resolve("kimi_k3", t.name, Selection(tactic=tactic))
            assert resolution.claimed, (t.name, tactic)
            assert resolution.bound_ids() == (KIMI_ID,)


def test_kimi_k3_targets_refuse_a_tactic_that_resolves_elsewhere_naming_what_and_why():
    # RULES TG3
    resolution = resolve("kimi_k3", "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4", Selection(tactic="eager"))
    assert not resolution.claimed
    assert resolution.refusals == (
        "moe_config.tactic 'eager' resolves to torch.eager.loop.w4a8_mxfp4_mxfp8 for the routed layers 1-92 (format "
        "w4a8_mxfp4_mxfp8 on sm_100); this target honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4 (RULES TG3)",
    )


def test_kimi_k3_targets_honor_any_draft_tactic():
    # RULES TG3 (scenario kimi_k3: external drafter)
    for t in decl("kimi_k3").targets:
        for draft_tactic in ("eager", "grouped_mm", "bf16.eager", "torch.grouped_mm.grouped_gemm.bf16"):
            resolution = resolve("kimi_k3", t.name, Selection(spec_mode="draft_target", draft_tactic=draft_tactic))
            assert resolution.claimed, (t.name, draft_tactic)


def test_glm_5_2_refuses_any_draft_tactic():
    # RULES TG3, TG2 (scenario glm_5_2: no draft_moe_impls_honored)
    resolution = resolve("glm_5_2", "glm_5_2_nvfp4__sm_107__low_latency", Selection(spec_mode="mtp", draft_tactic="eager.nvfp4"))
    assert resolution.refusals == (
        "speculative_config.moe_tactic 'eager.nvfp4' resolves to torch.eager.loop.nvfp4 for the draft layers 92 "
        "(format nvfp4 on sm_107); this target declares no draft_moe_impls_honored, so it honors no tactic (RULES TG2)",
    )


def test_glm_5_2_honors_its_one_target_id_by_tactic():
    # RULES TG3: the target tactic pins the target; the draft resolves AUTO and is claimed (TG4).
    resolution = resolve("glm_5_2", "glm_5_2_nvfp4__sm_107__low_latency", Selection(tactic="nvfp4", spec_mode="mtp"))
    assert resolution.claimed
    assert [(r.role, r.selected_by) for r in resolution.reports] == [("target", "pinned"), ("draft", "preferred")]


def test_minimax_m3_targets_honor_any_draft_tactic():
    # RULES TG3 (scenario minimax_m3)
    for t in decl("minimax_m3").targets:
        for draft_tactic in ("eager", "nvfp4", "torch", "eager.nvfp4", "torch.eager.loop.nvfp4"):
            resolution = resolve("minimax_m3", t.name, Selection(spec_mode="mtp", draft_tactic=draft_tactic))
            assert resolution.claimed, (t.name, draft_tactic)
            assert resolution.bound_ids("draft") == ("torch.eager.loop.nvfp4",)


def test_a_target_without_declared_ids_honors_no_tactic():
    # RULES TG3, TG2
    resolution = resolve_model(facts(site(0, "bf16")), Selection(tactic="eager.bf16"), sm=90, honored=Honored.parse(None))
    assert resolution.refusals == (
        "moe_config.tactic 'eager.bf16' resolves to torch.eager.loop.bf16 for the routed layers 0 (format bf16 on "
        "sm_90); this target declares no moe_impls_honored, so it honors no tactic (RULES TG2)",
    )


def test_honored_is_checked_against_every_implementation_the_tactic_can_resolve_to():
    # RULES TG3: 'torch' on sm_80 can resolve only to VANILLA (TORCH does not run there); honoring that
    # one id is enough, although the tactic matches TORCH ids too.
    resolution = resolve_model(facts(site(0, "bf16")), Selection(tactic="torch"), sm=80, honored=Honored.parse(["torch.eager.loop.bf16"]))
    assert resolution.claimed


# --- TG4: without a tactic, a declared set restricts the winner --------------------------------------


def test_auto_binds_the_first_eligible_honored_candidate():
    # RULES TG4
    resolution = resolve("kimi_k3", "kimi_k3_mxfp4__sm_100__tp16_moetp16ep1", Selection())
    (report,) = resolution.reports
    assert resolution.claimed and report.winner == KIMI_ID
    assert [r.describe() for r in report.rejections] == [
        "triton.wgmma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90)",
        "cupy.mma.grouped_gemm.w4a16_mxfp4: SM_UNSUPPORTED (sm_100 is not among sm_90)",
        "torch.eager.loop.w4a16_mxfp4: NOT_HONORED (the target honors only torch.grouped_mm.grouped_gemm.w4a16_mxfp4)",
    ]


def test_a_selection_with_no_eligible_honored_candidate_is_not_honored():
    # RULES TG4
    resolution = resolve("kimi_k3", "kimi_k3_mxfp4__sm_100__tp16_moetp4ep4", Selection(backend="VANILLA"))
    assert resolution.refusals == (
        "moe_config.backend 'VANILLA': no eligible honored implementation for routed layers 1-92 (format "
        "w4a8_mxfp4_mxfp8 on sm_100); it would run torch.eager.loop.w4a8_mxfp4_mxfp8, and this target honors only "
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4 (RULES TG4)",
    )
    assert resolution.reports[0].winner == "torch.eager.loop.w4a8_mxfp4_mxfp8"  # what the generic build runs


def test_a_target_declaring_no_draft_set_claims_a_draft_backend_and_binds_its_winner():
    # RULES TG4 (scenario glm_5_2: it honors no draft tactic but builds its MTP under moe_backend)
    for selection in (Selection(spec_mode="mtp", draft_backend="VANILLA"), Selection(spec_mode="mtp", draft_backend="AUTO"), Selection(spec_mode="mtp")):
        resolution = resolve("glm_5_2", "glm_5_2_nvfp4__sm_107__low_latency", selection)
        assert resolution.claimed
        assert resolution.bound_ids("draft") == ("torch.eager.loop.nvfp4",)


def test_any_honors_every_selection_and_does_not_restrict_the_winner():
    # RULES TG4
    resolution = resolve_model(facts(site(0, "bf16")), Selection(), sm=90, honored=Honored.parse("*"))
    assert resolution.claimed and resolution.reports[0].alternatives == ("cupy.mma.grouped_gemm.bf16", "torch.grouped_mm.grouped_gemm.bf16",
                                                                         "torch.eager.loop.bf16")


def test_an_empty_honored_list_honors_nothing():
    # RULES TG4
    resolution = resolve_model(facts(site(0, "bf16")), Selection(), sm=90, honored=Honored.parse([]))
    assert resolution.refusals == (
        "moe_config.backend 'AUTO': no eligible honored implementation for routed layers 0 (format bf16 on sm_90); "
        "it would run triton.wgmma.grouped_gemm.bf16, and this target honors no implementation (RULES TG4)",
    )


def _models_cli_error(tmp_path, text: str) -> tuple[int, str]:
    """`python -m codegen list --models DIR` (its main()) on one declaration: the exit code and stderr."""
    import contextlib
    import io

    from codegen.cli import main

    folder = tmp_path / "mine"
    folder.mkdir()
    write(folder / "m.toml", text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["list", "--models", str(folder)])
    return code, err.getvalue()


def test_an_honored_id_that_fails_the_shape_gate_on_every_layer_is_invalid_in_a_models_folder(tmp_path):
    # RULES TG2 (issue 10 §3): every eligibility gate, for the user's own declaration folders too
    text = TARGET_DECL.format(name="m", sm=90, second="cupy.mma.grouped_gemm.bf16").replace("intermediate_size = 128", "intermediate_size = 96")
    code, err = _models_cli_error(tmp_path, text)
    assert (code, err) == (2, (
        f"error: {tmp_path / 'mine' / 'm.toml'}:21: targets[0].moe_impls_honored: cupy.mma.grouped_gemm.bf16 is not "
        "eligible for any of this target's layers on sm_90 with parallel tp1: cupy.mma.grouped_gemm.bf16: SHAPE_UNALIGNED "
        "(intermediate shard 96 (moetp1) is not a multiple of 64); list an implementation that can serve them (RULES TG2)\n"
    ))


def test_an_honored_id_that_fails_the_topology_gate_is_invalid(tmp_path):
    # RULES TG2: 4 experts do not split over 8 expert-parallel ranks, whatever the implementation
    text = TARGET_DECL.format(name="m", sm=90, second="torch.eager.loop.bf16").replace('parallel = "tp1"', 'parallel = "tp8_moetp1ep8"')
    code, err = _models_cli_error(tmp_path, text)
    assert (code, err) == (2, (
        f"error: {tmp_path / 'mine' / 'm.toml'}:21: targets[0].moe_impls_honored: torch.grouped_mm.grouped_gemm.bf16 is not "
        "eligible for any of this target's layers on sm_90 with parallel tp8_moetp1ep8: torch.grouped_mm.grouped_gemm.bf16: "
        "TOPOLOGY_UNSUPPORTED (4 experts do not split over ep8); list an implementation that can serve them (RULES TG2)\n"
    ))


def test_an_honored_id_eligible_for_the_layers_loads(tmp_path):
    # RULES TG2: the same declaration with an aligned intermediate size is valid
    text = TARGET_DECL.format(name="m", sm=90, second="cupy.mma.grouped_gemm.bf16")
    assert _models_cli_error(tmp_path, text) == (0, "")

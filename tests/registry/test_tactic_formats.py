"""A tactic against the formats the target's layers run as (RULES FN3, FN4, FN5)."""

from __future__ import annotations

import dataclasses

import pytest

from registry.errors import ResolutionError
from registry.model_resolve import resolve_model
from registry.selection import Selection
from tests.registry.helpers import cupy_registry, facts, project_models, site

C = cupy_registry()


def refused(facts_, selection: Selection, sm: int, **kw) -> str:
    with pytest.raises(ResolutionError) as info:
        resolve_model(facts_, selection, sm=sm, **kw)
    return str(info.value)


def qwen3_next(policy: str | None = None):
    base = project_models()["qwen3_next"].facts()
    return dataclasses.replace(base, excluded_layers=policy) if policy else base


# --- FN3: one backend per format, after narrowing -------------------------------------------------


def test_a_tactic_naming_two_backends_for_one_format_is_refused_with_a_tactic_per_backend():
    # RULES FN3
    bf16 = facts(site(0, "bf16"), site(1, "bf16"))
    assert refused(bf16, Selection(tactic="grouped_gemm.bf16"), 100, registry=C) == (
        "moe_config.tactic 'grouped_gemm.bf16' names implementations of 2 backends for bf16 (routed layers 0-1 "
        "(test bf16)): CUPY, TORCH; pin one backend: 'cupy.grouped_gemm.bf16' (CUPY), 'torch.grouped_gemm.bf16' "
        "(TORCH) (RULES FN3)"
    )


def test_the_fn3_check_on_the_project_registry_suggests_the_narrowest_pin_per_backend():
    # RULES FN3 (scenario gpt_oss_120b)
    gpt_oss = project_models()["gpt_oss_120b"].facts()
    assert refused(gpt_oss, Selection(tactic="w4a16_mxfp4"), 90) == (
        "moe_config.tactic 'w4a16_mxfp4' names implementations of 4 backends for w4a16_mxfp4 (routed layers 0-35 "
        "(checkpoint quant_algo MXFP4)): CUPY, TORCH, TRITON, VANILLA; pin one backend: 'cupy.w4a16_mxfp4' (CUPY), "
        "'grouped_mm.w4a16_mxfp4' (TORCH), 'triton.w4a16_mxfp4' (TRITON), 'eager.w4a16_mxfp4' (VANILLA) (RULES FN3)"
    )
    # each suggested pin is accepted
    for pin, winner in (("cupy.w4a16_mxfp4", "cupy.mma.grouped_gemm.w4a16_mxfp4"),
                        ("grouped_mm.w4a16_mxfp4", "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"),
                        ("triton.w4a16_mxfp4", "triton.wgmma.grouped_gemm.w4a16_mxfp4"),
                        ("eager.w4a16_mxfp4", "torch.eager.loop.w4a16_mxfp4")):
        assert resolve_model(gpt_oss, Selection(tactic=pin), sm=90).reports[0].winner == winner


def test_a_tactic_spanning_backends_is_accepted_when_the_layers_formats_narrow_it_to_one():
    # RULES FN3: 'grouped_gemm' names CUPY and TORCH, but only CUPY serves nvfp4.
    report = resolve_model(facts(site(0, "nvfp4")), Selection(tactic="grouped_gemm"), sm=100, registry=C).reports[0]
    assert (report.winner, report.selected_by) == ("cupy.mma.grouped_gemm.nvfp4", "pinned")


def test_fn3_narrows_to_what_runs_on_the_target_sm():
    # RULES FN3: on sm_80 no TORCH implementation runs, so 'w4a16_mxfp4' names VANILLA alone there.
    gpt_oss = project_models()["gpt_oss_120b"].facts()
    assert resolve_model(gpt_oss, Selection(tactic="w4a16_mxfp4"), sm=80).reports[0].winner == "torch.eager.loop.w4a16_mxfp4"


def test_under_dynamic_eplb_fn3_counts_only_implementations_that_consume_plans():
    # RULES FN3, RQ4: VANILLA is turned down under EPLB anyway, so 'w4a16_mxfp4' pins TORCH alone and
    # no message suggests a VANILLA pin that RQ4 would refuse.
    gpt_oss = project_models()["gpt_oss_120b"].facts()
    report = resolve_model(gpt_oss, Selection(tactic="w4a16_mxfp4", eplb=True), sm=90).reports[0]
    assert (report.winner, report.selected_by) == ("torch.grouped_mm.grouped_gemm.w4a16_mxfp4", "pinned")
    assert [r.describe() for r in report.rejections] == [
        "triton.wgmma.grouped_gemm.w4a16_mxfp4: EPLB_UNSUPPORTED (does not consume per-layer dynamic EPLB plans)",
        "cupy.mma.grouped_gemm.w4a16_mxfp4: EPLB_UNSUPPORTED (does not consume per-layer dynamic EPLB plans)",
        "torch.eager.loop.w4a16_mxfp4: EPLB_UNSUPPORTED (does not consume per-layer dynamic EPLB plans)",
    ]


# --- FN4: a layer in a format the tactic does not name -------------------------------------------------


def test_a_layer_the_tactic_does_not_cover_lists_its_implementations_and_a_widened_tactic():
    # RULES FN4 (scenario qwen3_next under the default policy)
    assert refused(qwen3_next("tactic"), Selection(tactic="eager.nvfp4"), 100) == (
        "moe_config.tactic 'eager.nvfp4' names no implementation of bf16 on sm_100, the format of excluded layers "
        "0, 47 (excluded from quantization by 'model.layers.0.mlp.experts*'; excluded from quantization by "
        "'model.layers.47.mlp.experts*'); bf16 is served by torch.grouped_mm.grouped_gemm.bf16 ('grouped_mm.bf16'), "
        "torch.eager.loop.bf16 ('eager.bf16'); 'eager' covers bf16, nvfp4 within VANILLA (RULES FN4)"
    )


def test_the_widened_tactic_drops_the_fewest_segments_within_one_backend():
    # RULES FN4
    mixed = facts(site(0, "nvfp4"), site(1, "nvfp4"), site(2, "bf16", excluded=True, source="excluded"))
    assert refused(mixed, Selection(tactic="cupy.nvfp4"), 100, registry=C) == (
        "moe_config.tactic 'cupy.nvfp4' names no implementation of bf16 on sm_100, the format of excluded layers 2 "
        "(excluded); bf16 is served by cupy.mma.grouped_gemm.bf16 ('cupy.bf16'), torch.grouped_mm.grouped_gemm.bf16 "
        "('grouped_mm.bf16'), torch.eager.loop.bf16 ('eager.bf16'); 'cupy' covers bf16, nvfp4 within CUPY (RULES FN4)"
    )


def test_when_no_tactic_of_one_backend_covers_every_format_the_message_says_to_select_by_backend():
    # RULES FN4
    assert refused(qwen3_next("tactic"), Selection(tactic="nvfp4"), 100) == (
        "moe_config.tactic 'nvfp4' names no implementation of bf16 on sm_100, the format of excluded layers 0, 47 "
        "(excluded from quantization by 'model.layers.0.mlp.experts*'; excluded from quantization by "
        "'model.layers.47.mlp.experts*'); bf16 is served by torch.grouped_mm.grouped_gemm.bf16 ('grouped_mm.bf16'), "
        "torch.eager.loop.bf16 ('eager.bf16'); no tactic of one backend covers bf16, nvfp4: select by backend "
        "(moe_config.backend) instead (RULES FN4)"
    )
    assert refused(facts(site(0, "nvfp4")), Selection(tactic="grouped_mm"), 100) == (
        "moe_config.tactic 'grouped_mm' names no implementation of nvfp4 on sm_100, the format of routed layers 0 "
        "(test nvfp4); nvfp4 is served by torch.eager.loop.nvfp4 ('nvfp4'); no tactic of one backend covers nvfp4: "
        "select by backend (moe_config.backend) instead (RULES FN4)"
    )


# --- FN5: excluded layers ----------------------------------------------------------------------------


def test_a_target_tactic_applies_to_excluded_layers_under_the_default_policy():
    # RULES FN5: 'eager' covers nvfp4 and bf16 within VANILLA; the excluded layers are pinned too.
    resolution = resolve_model(qwen3_next("tactic"), Selection(tactic="eager"), sm=100)
    by_role = {r.role: r for r in resolution.reports}
    assert (by_role["target"].winner, by_role["target"].selected_by) == ("torch.eager.loop.nvfp4", "pinned")
    assert (by_role["excluded"].winner, by_role["excluded"].selected_by) == ("torch.eager.loop.bf16", "pinned")
    assert by_role["excluded"].layers == (0, 47)
    assert resolution.warnings == ()


def test_under_the_backend_policy_excluded_layers_build_under_the_backend_with_one_warning():
    # RULES FN5 (scenario qwen3_next: excluded_layers = "backend")
    resolution = resolve_model(qwen3_next(), Selection(tactic="nvfp4"), sm=100)
    target, excluded = resolution.reports
    assert (target.role, target.winner, target.selected_by, target.requested) == (
        "target",
        "torch.eager.loop.nvfp4",
        "pinned",
        "*.*.*.nvfp4",
    )
    assert (excluded.role, excluded.layers, excluded.requested, excluded.field) == ("excluded", (0, 47), "AUTO", "moe_config.backend")
    assert (excluded.winner, excluded.selected_by) == ("torch.grouped_mm.grouped_gemm.bf16", "preferred")
    warning = (
        "excluded layers 0, 47 run bf16 (excluded from quantization) and build under moe_config.backend 'AUTO', "
        "skipping moe_config.tactic 'nvfp4' (RULES FN5)"
    )
    assert resolution.warnings == (warning,)
    assert excluded.warnings == (warning,)


def test_under_the_backend_policy_no_tactic_means_no_warning():
    # RULES FN5: the warning names a skipped tactic; without one nothing is skipped.
    resolution = resolve_model(qwen3_next(), Selection(), sm=100)
    assert resolution.warnings == ()
    assert {r.role: r.requested for r in resolution.reports} == {"target": "AUTO", "excluded": "AUTO"}

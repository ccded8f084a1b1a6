"""Draft MoE layers: their own selection, formats and constraints (RULES DR1-DR7), on the scenarios."""

from __future__ import annotations

import dataclasses

import pytest

from registry.errors import ResolutionError, SelectionError, TacticError
from registry.model_resolve import resolve_model
from registry.selection import Selection
from registry.declarations import MODELS_DIR, load_declaration
from tests.registry.helpers import project_models, write


def model(name: str, checkpoint: str | None = None):
    return project_models()[name].facts(checkpoint)


def resolve(name: str, selection: Selection, sm: int, **kw):
    return resolve_model(model(name), selection, sm=sm, **kw)


def drafts(resolution):
    return [r for r in resolution.reports if r.role == "draft"]


def targets(resolution):
    return [r for r in resolution.reports if r.role != "draft"]


def error(name, selection, sm, kind=ResolutionError, **kw) -> str:
    with pytest.raises(kind) as info:
        resolve(name, selection, sm, **kw)
    return str(info.value)


# --- DR1: moe_config is the target's; the draft takes its own fields, else inherits -----------------


def test_a_target_tactic_never_reaches_the_bf16_mtp_the_draft_resolves_auto():
    # RULES DR1, DR2 (scenario deepseek_r1_nvfp4)
    resolution = resolve("deepseek_r1_nvfp4", Selection(tactic="nvfp4", spec_mode="mtp"), 100)
    (target,) = targets(resolution)
    (draft,) = drafts(resolution)
    assert (target.requested, target.winner, target.selected_by) == ("*.*.*.nvfp4", "torch.eager.loop.nvfp4", "pinned")
    assert (draft.layers, draft.checkpoint_format, draft.format_source) == ((61,), "bf16", "excluded from quantization by 'model.layers.61*'")
    assert (draft.requested, draft.field, draft.winner, draft.selected_by) == (
        "AUTO",
        "speculative_config.moe_backend",
        "torch.grouped_mm.grouped_gemm.bf16",
        "preferred",
    )
    assert resolution.notes == (
        "the draft resolves AUTO for its own weights: moe_config.tactic pins the target only and "
        "speculative_config.moe_backend/speculative_config.moe_tactic are unset (RULES DR1)",
    )


def test_with_both_draft_fields_unset_the_draft_inherits_the_target_backend():
    # RULES DR1 (scenario nemotron_h)
    resolution = resolve("nemotron_h", Selection(backend="VANILLA", spec_mode="mtp"), 100)
    (draft,) = drafts(resolution)
    assert (draft.requested, draft.winner) == ("VANILLA", "torch.eager.loop.bf16")
    assert resolution.notes == ("the draft inherits moe_config.backend 'VANILLA' (speculative_config.moe_backend is unset) (RULES DR1)",)


def test_an_inherited_auto_stays_auto_and_resolves_against_the_drafts_own_weights():
    # RULES DR1 (as updated), DR2 (scenario deepseek_r1_nvfp4): NVFP4 target, BF16 MTP layer
    resolution = resolve("deepseek_r1_nvfp4", Selection(spec_mode="mtp"), 100)
    (target,) = targets(resolution)
    (draft,) = drafts(resolution)
    assert (target.run_format, target.winner) == ("nvfp4", "torch.eager.loop.nvfp4")
    assert (draft.requested, draft.field, draft.run_format, draft.winner, draft.selected_by) == (
        "AUTO", "speculative_config.moe_backend", "bf16", "torch.grouped_mm.grouped_gemm.bf16", "preferred",
    )
    assert resolution.notes == ("the draft inherits moe_config.backend 'AUTO' (speculative_config.moe_backend is unset) (RULES DR1)",)


def test_a_draft_tactic_pins_and_a_draft_backend_selects():
    # RULES DR1 (scenario minimax_m3: three MTP modules in NVFP4)
    pinned = drafts(resolve("minimax_m3", Selection(spec_mode="mtp", draft_tactic="eager.nvfp4"), 103))
    assert [(d.layers, d.requested, d.field, d.selected_by) for d in pinned] == [
        ((62, 63, 64), "*.eager.*.nvfp4", "speculative_config.moe_tactic", "pinned")
    ]
    selected = drafts(resolve("minimax_m3", Selection(spec_mode="mtp", draft_backend="VANILLA"), 103))
    assert [(d.requested, d.field, d.selected_by) for d in selected] == [("VANILLA", "speculative_config.moe_backend", "preferred")]


def test_an_explicit_auto_draft_backend_next_to_a_draft_tactic_lets_the_tactic_pin():
    # RULES DR1, TA4
    (draft,) = drafts(resolve("minimax_m3", Selection(spec_mode="mtp", draft_backend="AUTO", draft_tactic="nvfp4"), 107))
    assert draft.selected_by == "pinned"


def test_a_mode_the_model_has_no_draft_for_is_refused_with_the_modes_it_serves():
    # RULES DR1
    assert error("kimi_k3", Selection(spec_mode="mtp"), 100, SelectionError) == (
        "kimi_k3 has no draft for speculative_config.mode 'mtp'; its drafts serve: draft_target, dspark"
    )


# --- DR2: a draft's AUTO resolves against its own formats -------------------------------------------


def test_an_external_drafter_resolves_against_its_own_checkpoint():
    # RULES DR2 (scenario kimi_k3: MXFP4 target, bf16 external drafter)
    resolution = resolve("kimi_k3", Selection(spec_mode="draft_target"), 100)
    (target,) = targets(resolution)
    (draft,) = drafts(resolution)
    assert (target.checkpoint_format, target.run_format) == ("mxfp4", "w4a16_mxfp4")
    assert (draft.checkpoint_format, draft.format_source, draft.winner) == (
        "bf16",
        "unquantized checkpoint",
        "torch.grouped_mm.grouped_gemm.bf16",
    )


def test_a_mixed_precision_mtp_resolves_against_its_own_entry():
    # RULES DR2 (scenario qwen3_8_flash: NVFP4 target, FP8-block MTP)
    resolution = resolve("qwen3_8_flash", Selection(spec_mode="mtp"), 100)
    (target,) = targets(resolution)
    (draft,) = drafts(resolution)
    assert (target.run_format, target.winner) == ("nvfp4", "torch.eager.loop.nvfp4")
    assert (draft.layers, draft.run_format, draft.format_source, draft.winner) == (
        (48,),
        "fp8_block_scales",
        "per-layer entry 'mtp.layers.*.mlp.experts.*': FP8_BLOCK_SCALES",
        "torch.grouped_mm.grouped_gemm.fp8_block_scales",
    )


def test_a_draft_tactic_covering_only_the_target_format_is_refused_for_the_mixed_precision_mtp():
    # RULES DR2, FN4 (scenario qwen3_8_flash)
    assert error("qwen3_8_flash", Selection(spec_mode="mtp", draft_tactic="nvfp4"), 100) == (
        "speculative_config.moe_tactic 'nvfp4' names no implementation of fp8_block_scales on sm_100, the format of "
        "draft layers 48 (per-layer entry 'mtp.layers.*.mlp.experts.*': FP8_BLOCK_SCALES); fp8_block_scales is served "
        "by torch.grouped_mm.grouped_gemm.fp8_block_scales ('grouped_mm.fp8_block_scales'), "
        "torch.eager.loop.fp8_block_scales ('eager.fp8_block_scales'); no tactic of one backend covers "
        "fp8_block_scales: select by backend (speculative_config.moe_backend) instead (RULES FN4)"
    )
    (draft,) = drafts(resolve("qwen3_8_flash", Selection(spec_mode="mtp", draft_tactic="grouped_mm"), 100))
    assert (draft.winner, draft.selected_by) == ("torch.grouped_mm.grouped_gemm.fp8_block_scales", "pinned")


def test_an_excluded_mtp_layer_is_a_draft_layer_pinned_by_the_draft_tactic():
    # RULES DR2, FN5 (scenario qwen3_next: the MTP is excluded, so bf16; the target tactic skips it)
    resolution = resolve("qwen3_next", Selection(tactic="nvfp4", spec_mode="mtp", draft_tactic="grouped_mm.bf16"), 100)
    (draft,) = drafts(resolution)
    assert (draft.layers, draft.checkpoint_format, draft.format_source) == ((48,), "bf16", "excluded from quantization by 'mtp*'")
    assert (draft.requested, draft.winner, draft.selected_by) == ("*.grouped_mm.*.bf16", "torch.grouped_mm.grouped_gemm.bf16", "pinned")
    assert error("qwen3_next", Selection(spec_mode="mtp", draft_tactic="nvfp4"), 100) == (
        "speculative_config.moe_tactic 'nvfp4' names no implementation of bf16 on sm_100, the format of draft layers "
        "48 (excluded from quantization by 'mtp*'); bf16 is served by torch.grouped_mm.grouped_gemm.bf16 "
        "('grouped_mm.bf16'), torch.eager.loop.bf16 ('eager.bf16'); no tactic of one backend covers bf16: select by "
        "backend (speculative_config.moe_backend) instead (RULES FN4)"
    )


def test_a_replacement_head_resolves_against_its_own_checkpoint(tmp_path):
    # RULES DR2: replacement MTP heads load from their own checkpoint, here FP8 blocks under a bf16 target.
    source = (MODELS_DIR / "tiny_deepseek_v3.toml").read_text(encoding="utf-8")
    text = source[: source.index("[[drafts]]")].replace('name = "tiny_deepseek_v3"\n', 'name = "tiny_rep"\n', 1) + (
        '[[drafts]]\nname = "tiny_rep_heads"\nkind = "replacement_mtp"\nmodes = ["mtp"]\n'
        'checkpoint = { name = "tiny_rep_heads_fp8", quant_algo = "FP8_BLOCK_SCALES" }\n'
    )
    facts = load_declaration(write(tmp_path / "tiny_rep.toml", text)).facts()
    resolution = resolve_model(facts, Selection(spec_mode="mtp"), sm=90)
    assert [(r.role, r.layers, r.run_format, r.winner) for r in resolution.reports] == [
        ("target", (1, 2), "bf16", "triton.wgmma.grouped_gemm.bf16"),
        ("draft", (3,), "fp8_block_scales", "triton.wgmma.grouped_gemm.fp8_block_scales"),
    ]


# --- DR3: a draft selection never changes the target's ----------------------------------------------


@pytest.mark.parametrize(
    "name, sm, base, draft_fields",
    [
        ("deepseek_r1_nvfp4", 100, Selection(tactic="nvfp4", spec_mode="mtp"), [{}, {"draft_tactic": "eager.bf16"}, {"draft_backend": "VANILLA"}]),
        ("qwen3_next", 100, Selection(tactic="nvfp4", spec_mode="mtp"), [{}, {"draft_tactic": "grouped_mm.bf16"}, {"draft_backend": "TORCH"}]),
        ("deepseek_v4_flash", 100, Selection(spec_mode="dspark"), [{}, {"draft_tactic": "eager"}, {"draft_backend": "VANILLA"}]),
        ("kimi_k3", 100, Selection(spec_mode="draft_target"), [{}, {"draft_tactic": "eager"}, {"draft_backend": "TORCH"}]),
    ],
)
def test_draft_fields_never_change_the_target_reports(name, sm, base, draft_fields):
    # RULES DR3
    reference = targets(resolve(name, dataclasses.replace(base, spec_mode=None), sm))
    for fields in draft_fields:
        assert targets(resolve(name, dataclasses.replace(base, **fields), sm)) == reference


# --- DR4: modes without a neural drafter ignore the draft fields ----------------------------------------


@pytest.mark.parametrize("mode", ["ngram", "prompt_lookup"])
def test_non_neural_modes_ignore_the_draft_fields_and_say_so(mode):
    # RULES DR4: even a draft tactic that no draft could serve is ignored, not refused.
    resolution = resolve("qwen3_next", Selection(spec_mode=mode, draft_backend="AUTO", draft_tactic="nvfp4"), 100)
    assert drafts(resolution) == []
    assert resolution.notes == (
        f"speculative_config.mode {mode!r} has no neural drafter: speculative_config.moe_backend and "
        "speculative_config.moe_tactic ignored (RULES DR4)",
    )
    plain = resolve("qwen3_next", Selection(spec_mode=mode), 100)
    assert plain.notes == (f"speculative_config.mode {mode!r} has no neural drafter: no draft MoE layers to select (RULES DR4)",)
    assert targets(plain) == targets(resolution)


# --- DR5: the embedded MTP runs VANILLA exactly when the target does ----------------------------------


def test_nemotron_h_refuses_a_vanilla_target_with_a_non_vanilla_mtp():
    # RULES DR5 (scenario nemotron_h)
    assert error("nemotron_h", Selection(backend="VANILLA", spec_mode="mtp", draft_backend="TORCH"), 100) == (
        "nemotron_h: the embedded MTP of nemotron_h_mtp must run VANILLA exactly when the target does (its checkpoint "
        "weight mapping differs only there); the target runs torch.eager.loop.bf16, the draft would run "
        "torch.grouped_mm.grouped_gemm.bf16; select the draft with speculative_config.moe_backend or "
        "speculative_config.moe_tactic so that both or neither run VANILLA (RULES DR5)"
    )


def test_nemotron_h_refuses_a_vanilla_mtp_under_a_non_vanilla_target():
    # RULES DR5
    assert error("nemotron_h", Selection(spec_mode="mtp", draft_tactic="eager"), 100) == (
        "nemotron_h: the embedded MTP of nemotron_h_mtp must run VANILLA exactly when the target does (its checkpoint "
        "weight mapping differs only there); the target runs torch.grouped_mm.grouped_gemm.bf16, the draft would run "
        "torch.eager.loop.bf16; select the draft with speculative_config.moe_backend or speculative_config.moe_tactic "
        "so that both or neither run VANILLA (RULES DR5)"
    )


def test_nemotron_h_a_pinned_vanilla_target_needs_a_vanilla_draft_selection():
    # RULES DR5, DR1: the target tactic pins the target only; the draft's AUTO would pick TORCH.
    with pytest.raises(ResolutionError):
        resolve("nemotron_h", Selection(tactic="eager", spec_mode="mtp"), 100)
    resolution = resolve("nemotron_h", Selection(tactic="eager", spec_mode="mtp", draft_backend="VANILLA"), 100)
    assert {r.backend for r in resolution.reports} == {"VANILLA"}


def test_nemotron_h_accepts_both_or_neither_on_vanilla():
    # RULES DR5
    for selection in (
        Selection(spec_mode="mtp"),
        Selection(backend="VANILLA", spec_mode="mtp"),
        Selection(backend="TORCH", spec_mode="mtp", draft_tactic="grouped_mm"),
    ):
        resolution = resolve("nemotron_h", selection, 100)
        assert len({r.backend for r in resolution.reports}) == 1
    (report, _) = resolve("nemotron_h", Selection(spec_mode="mtp"), 100).reports
    assert report.layers[:3] == (1, 3, 6) and len(report.layers) == 23  # the 'E' layers of the pattern


# --- DR6: drafts in the target's load balancer resolve AUTO under EPLB as the target does ------------


def test_an_embedded_mtp_under_dynamic_eplb_resolves_auto_among_eplb_consumers():
    # RULES DR6 (scenario deepseek_v3: FP8 MTP)
    (draft,) = drafts(resolve("deepseek_v3", Selection(spec_mode="mtp", eplb=True), 90))
    assert (draft.winner, draft.alternatives) == ("torch.grouped_mm.grouped_gemm.fp8_block_scales", ())
    (free,) = drafts(resolve("deepseek_v3", Selection(spec_mode="mtp"), 90))
    assert free.alternatives == ("cupy.mma.grouped_gemm.fp8_block_scales",
                                 "torch.grouped_mm.grouped_gemm.fp8_block_scales", "torch.eager.loop.fp8_block_scales")


def test_a_draft_backend_without_eplb_consumers_is_refused_for_a_balanced_draft():
    # RULES DR6, RQ4
    assert error("deepseek_v3", Selection(spec_mode="mtp", eplb=True, draft_backend="VANILLA"), 90, SelectionError) == (
        "speculative_config.moe_backend 'VANILLA' under dynamic EPLB: no VANILLA implementation consumes EPLB plans; "
        "backends that do: TORCH (RULES RQ4)"
    )
    assert error("deepseek_v3", Selection(spec_mode="mtp", eplb=True, draft_tactic="eager.fp8_block_scales"), 90, TacticError) == (
        "speculative_config.moe_tactic 'eager.fp8_block_scales' under dynamic EPLB names no implementation that "
        "consumes EPLB plans; it matches torch.eager.loop.fp8_block_scales (RULES RQ4)"
    )


def test_an_external_drafter_is_outside_the_target_load_balancer():
    # RULES DR6: the kimi_k3 drafter has its own weights; EPLB does not filter its candidates.
    (draft,) = drafts(resolve("kimi_k3", Selection(spec_mode="draft_target", eplb=True, draft_backend="VANILLA"), 100))
    assert (draft.winner, draft.rejections) == ("torch.eager.loop.bf16", ())
    (auto,) = drafts(resolve("kimi_k3", Selection(spec_mode="draft_target", eplb=True), 100))
    assert auto.alternatives == ("torch.eager.loop.bf16",)
    (target,) = targets(resolve("kimi_k3", Selection(spec_mode="draft_target", eplb=True), 100))
    assert target.alternatives == ()  # the target itself is balanced: VANILLA is not a candidate


# --- DR7: embedded draft stages resolve against their own formats only -------------------------------


def test_draft_stages_resolve_against_their_mxfp4_format_only():
    # RULES DR7 (scenario deepseek_v4_flash: NVFP4 target, MXFP4 draft stages)
    resolution = resolve("deepseek_v4_flash", Selection(spec_mode="dspark", draft_tactic="grouped_mm"), 100)
    (target,) = targets(resolution)
    (draft,) = drafts(resolution)
    assert (target.run_format, target.requested) == ("nvfp4", "AUTO")
    assert (draft.layers, draft.checkpoint_format, draft.run_format, draft.winner) == (
        (61, 62),
        "mxfp4",
        "w4a16_mxfp4",
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4",
    )
    # 'grouped_mm' names no nvfp4 implementation: it would fail on the target, but the stages only see MXFP4.
    with pytest.raises(ResolutionError):
        resolve("deepseek_v4_flash", Selection(tactic="grouped_mm", spec_mode="dspark"), 100)


def test_a_draft_stage_tactic_picks_the_stages_mxfp4_run_format():
    # RULES DR7, FN2: VANILLA alone in the request counts, so the SM's first choice.
    (draft,) = drafts(resolve("deepseek_v4_flash", Selection(spec_mode="dspark", draft_tactic="eager"), 100))
    assert (draft.run_format, draft.winner) == ("w4a8_mxfp4_mxfp8", "torch.eager.loop.w4a8_mxfp4_mxfp8")


def test_a_draft_stage_tactic_naming_only_the_target_format_is_refused_naming_the_mxfp4_formats():
    # RULES DR7, FN2
    assert error("deepseek_v4_flash", Selection(spec_mode="dspark", draft_tactic="nvfp4"), 100) == (
        "speculative_config.moe_tactic 'nvfp4' names no MXFP4 run format that runs on sm_100: the MXFP4 experts need "
        "one of w4a8_mxfp4_mxfp8, w4a8_mxfp4_fp8, w4a16_mxfp4 (RULES FN2)"
    )


def test_a_pinned_target_leaves_the_draft_stages_to_auto_on_their_own_format():
    # RULES DR7, DR1
    (draft,) = drafts(resolve("deepseek_v4_flash", Selection(tactic="nvfp4", spec_mode="dspark"), 100))
    assert (draft.requested, draft.run_format, draft.winner) == ("AUTO", "w4a16_mxfp4", "torch.grouped_mm.grouped_gemm.w4a16_mxfp4")

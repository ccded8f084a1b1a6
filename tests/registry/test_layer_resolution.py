"""Per-layer resolution: pins that fail, preferences that degrade, reports (RULES LR3, LR4, LR5)."""

from __future__ import annotations

import json

import pytest

from registry.errors import ResolutionError
from contract import MoeShape
from registry.model import DraftFacts
from registry.model_resolve import resolve_model
from registry.selection import Selection
from registry.impls import load_registry_text
from tests.registry.helpers import BACKENDS, cupy_registry, facts, impl_toml, project_models, site, small_registry_text

C = cupy_registry()
ODD = MoeShape(hidden_size=100, intermediate_size=512, num_experts=8, top_k=2, activation="silu_glu", expert_bias=False)
RELU2 = MoeShape(hidden_size=1024, intermediate_size=512, num_experts=8, top_k=2, activation="relu2", expert_bias=False)


def error(facts_, selection, sm, **kw) -> str:
    with pytest.raises(ResolutionError) as info:
        resolve_model(facts_, selection, sm=sm, **kw)
    return str(info.value)


# --- LR3: a pin with no eligible candidate fails, naming the field then each reason -------------------


def test_a_pinned_tactic_with_no_eligible_candidate_fails_naming_the_field_and_each_reason():
    # RULES LR3
    assert error(facts(site(0, "bf16"), shape=ODD), Selection(tactic="grouped_mm.bf16"), 90) == (
        "moe_config.tactic 'grouped_mm.bf16' pins routed layers 0 (format bf16 on sm_90), but no implementation it "
        "names can serve it: torch.grouped_mm.grouped_gemm.bf16: SHAPE_UNALIGNED (hidden size 100 is not a multiple "
        "of 8) (RULES LR3)"
    )


def test_a_pinned_tactic_never_falls_back_even_when_another_backend_could_serve():
    # RULES LR3, RQ2: AUTO would run VANILLA here; the pin does not.
    odd = facts(site(0, "bf16"), shape=ODD)
    assert resolve_model(odd, Selection(), sm=90).reports[0].winner == "torch.eager.loop.bf16"
    with pytest.raises(ResolutionError):
        resolve_model(odd, Selection(tactic="torch.grouped_mm"), sm=90)


def test_a_pinned_draft_tactic_names_the_draft_field():
    # RULES LR3: the field that set the tactic is speculative_config.moe_tactic.
    draft = DraftFacts("d", "embedded_mtp", ("mtp",), (site(9, "bf16"),), ODD)
    model = facts(site(0, "bf16"), drafts=(draft,))
    assert error(model, Selection(spec_mode="mtp", draft_tactic="grouped_mm"), 90) == (
        "speculative_config.moe_tactic 'grouped_mm' pins draft layers 9 (format bf16 on sm_90), but no implementation "
        "it names can serve it: torch.grouped_mm.grouped_gemm.bf16: SHAPE_UNALIGNED (hidden size 100 is not a "
        "multiple of 8) (RULES LR3)"
    )


def test_every_candidate_of_a_failing_pin_gives_its_reason_in_priority_order():
    # RULES LR3: two CUPY bf16 kernels, each turned down for its own reason.
    two = load_registry_text(
        small_registry_text(
            impl_toml("cupy.mma.grouped_gemm.bf16", "CUPY", 100, activations='["silu_glu"]'),
            impl_toml("cupy.wgmma.grouped_gemm.bf16", "CUPY", 101, sms="[90]"),
            backends=BACKENDS + '\n[backends.CUPY]\ndoc = "c"\n',
        )
    )
    assert error(facts(site(0, "bf16"), shape=RELU2), Selection(tactic="cupy"), 100, registry=two) == (
        "moe_config.tactic 'cupy' pins routed layers 0 (format bf16 on sm_100), but no implementation it names can "
        "serve it: cupy.mma.grouped_gemm.bf16: ACTIVATION_UNSUPPORTED (relu2 is not among silu_glu); "
        "cupy.wgmma.grouped_gemm.bf16: SM_UNSUPPORTED (sm_100 is not among sm_90) (RULES LR3)"
    )


# --- LR4: a preference degrades to the fallback, recorded and warned once per layer kind -----------


def test_a_literal_whose_own_candidates_all_reject_degrades_to_the_fallback_with_a_warning():
    # RULES LR4
    resolution = resolve_model(facts(site(0, "bf16"), site(1, "bf16"), shape=RELU2), Selection(backend="CUPY"), sm=100, registry=C)
    (report,) = resolution.reports
    assert (report.winner, report.backend, report.selected_by) == ("torch.grouped_mm.grouped_gemm.bf16", "TORCH", "fallback")
    warning = (
        "moe_config.backend 'CUPY': no CUPY implementation can serve routed layers 0-1 (format bf16 on sm_100); "
        "degraded to torch.grouped_mm.grouped_gemm.bf16 (TORCH): cupy.mma.grouped_gemm.bf16: ACTIVATION_UNSUPPORTED "
        "(relu2 is not among silu_glu) (RULES LR4)"
    )
    assert report.warnings == (warning,)
    assert resolution.warnings == (warning,)


def test_degradation_is_warned_once_per_layer_kind():
    # RULES LR4: two layer kinds degrade, two warnings; the 2 layers of one kind share one.
    model = facts(site(0, "bf16"), site(1, "bf16"), site(4, "fp8_block_scales"), shape=RELU2)
    resolution = resolve_model(model, Selection(backend="CUPY"), sm=100, registry=C)
    assert [r.selected_by for r in resolution.reports] == ["fallback", "fallback"]
    assert len(resolution.warnings) == 2
    assert resolution.warnings[1] == (
        "moe_config.backend 'CUPY': no CUPY implementation can serve routed layers 4 (format fp8_block_scales on "
        "sm_100); degraded to torch.grouped_mm.grouped_gemm.fp8_block_scales (TORCH): CUPY has no fp8_block_scales "
        "implementation (RULES LR4)"
    )


def test_a_preference_that_can_serve_is_not_a_degradation():
    # RULES LR4, RQ3
    resolution = resolve_model(facts(site(0, "bf16")), Selection(backend="CUPY"), sm=100, registry=C)
    assert resolution.reports[0].selected_by == "preferred"
    assert resolution.reports[0].winner == "cupy.mma.grouped_gemm.bf16"
    assert resolution.warnings == ()


def test_vanilla_never_degrades_and_auto_never_falls_back():
    # RULES LR4, RQ1, RQ3
    assert error(facts(site(0, "bf16")), Selection(backend="VANILLA"), 100, ep=3) == (
        "moe_config.backend 'VANILLA' found no implementation for routed layers 0 (format bf16 on sm_100): "
        "torch.eager.loop.bf16: TOPOLOGY_UNSUPPORTED (8 experts do not split over ep3) (RULES LR4)"
    )
    report = resolve_model(facts(site(0, "bf16"), shape=ODD), Selection(), sm=90).reports[0]
    assert report.selected_by == "preferred"  # VANILLA won AUTO on its own merit


def test_a_request_without_a_candidate_of_the_format_says_which_implementations_serve_it():
    # RULES LR4: TORCH has no nvfp4 implementation; the message names the one that exists.
    assert error(facts(site(0, "nvfp4")), Selection(backend="TORCH"), 100) == (
        "moe_config.backend 'TORCH' found no implementation for routed layers 0 (format nvfp4 on sm_100): the request "
        "holds no nvfp4 implementation; nvfp4 is served by torch.eager.loop.nvfp4 (VANILLA) (RULES LR4)"
    )
    assert error(facts(site(0, "nvfp4")), Selection(eplb=True), 100) == (
        "moe_config.backend 'AUTO' found no implementation for routed layers 0 (format nvfp4 on sm_100): the request "
        "holds no nvfp4 implementation that consumes EPLB plans; nvfp4 is served by torch.eager.loop.nvfp4 (VANILLA) "
        "(RULES LR4)"
    )
    assert error(facts(site(0, "w4a8_awq")), Selection(), 100) == (
        "moe_config.backend 'AUTO' found no implementation for routed layers 0 (format w4a8_awq on sm_100): no "
        "implementation of w4a8_awq is registered (RULES LR4)"
    )


# --- LR5: every resolution yields a report -----------------------------------------------------------


def test_the_report_names_requested_winner_selected_by_alternatives_and_rejections():
    # RULES LR5
    resolution = resolve_model(facts(site(0, "bf16"), site(1, "bf16"), shape=ODD), Selection(), sm=90)
    (report,) = resolution.reports
    assert report.to_dict() == {
        "role": "target",
        "layers": [0, 1],
        "checkpoint_format": "bf16",
        "format_source": "test bf16",
        "run_format": "bf16",
        "run_format_source": "checkpoint format",
        "requested": "AUTO",
        "field": "moe_config.backend",
        "winner": "torch.eager.loop.bf16",
        "winner_class": "runtime.experts.vanilla:TorchEagerBf16Experts",
        "backend": "VANILLA",
        "selected_by": "preferred",
        "weights": "unquantized, used as loaded",
        "verification": "runs on sm_90: verified (tests passed there)",
        "alternatives": [],
        "rejections": [
            {"impl": "triton.wgmma.grouped_gemm.bf16", "reason": "SHAPE_UNALIGNED", "detail": "hidden size 100 is not a multiple of 64"},
            {"impl": "cupy.mma.grouped_gemm.bf16", "reason": "SHAPE_UNALIGNED", "detail": "hidden size 100 is not a multiple of 64"},
            {"impl": "torch.grouped_mm.grouped_gemm.bf16", "reason": "SHAPE_UNALIGNED", "detail": "hidden size 100 is not a multiple of 8"},
        ],
        "warnings": [],
    }
    json.dumps(report.to_dict())  # serializable as resolution.json


def test_a_tactic_is_reported_in_canonical_form_and_as_pinned():
    # RULES LR5, TA1
    report = resolve_model(facts(site(0, "bf16")), Selection(tactic="BF16.Eager"), sm=90).reports[0]
    assert (report.requested, report.field, report.selected_by, report.winner) == (
        "*.eager.*.bf16",
        "moe_config.tactic",
        "pinned",
        "torch.eager.loop.bf16",
    )


def test_the_eligible_alternatives_are_listed_besides_the_winner():
    # RULES LR5
    report = resolve_model(facts(site(0, "bf16")), Selection(), sm=100, registry=C).reports[0]
    assert report.winner == "cupy.mma.grouped_gemm.bf16"
    assert report.alternatives == ("torch.grouped_mm.grouped_gemm.bf16", "torch.eager.loop.bf16")


def test_every_layer_kind_of_a_scenario_has_a_report():
    # RULES LR5 (scenario qwen3_next with its MTP)
    resolution = resolve_model(project_models()["qwen3_next"].facts(), Selection(spec_mode="mtp"), sm=100)
    assert [(r.role, r.layers[0], len(r.layers)) for r in resolution.reports] == [
        ("target", 1, 46),
        ("excluded", 0, 2),
        ("draft", 48, 1),
    ]
    assert {r.selected_by for r in resolution.reports} <= {"pinned", "preferred", "fallback"}

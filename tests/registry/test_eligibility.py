"""Eligibility gates: pure, data-driven, each rejection with a reason and a detail (RULES LR1, LR2)."""

from __future__ import annotations

import pytest

from registry.eligibility import Deployment, Problem, Reason, Rejection, eligibility
from registry.impls import load_registry_text
from registry.resolve import ask_candidates, moe_impl_request
from tests.registry.helpers import cupy_registry, impl_toml, real_registry, small_registry_text

R = real_registry()
C = cupy_registry()
CUPY_BF16 = C.impl("cupy.mma.grouped_gemm.bf16")  # silu_glu only, no bias, no MoE TP, hidden % 128, inter % 64
TORCH_BF16 = R.impl("torch.grouped_mm.grouped_gemm.bf16")
TORCH_FP8 = R.impl("torch.grouped_mm.grouped_gemm.fp8_block_scales")
EAGER_BF16 = R.impl("torch.eager.loop.bf16")


def rejected(impl, problem: Problem, deployment: Deployment) -> tuple[Reason, str]:
    rejection = eligibility(impl, problem, deployment)
    assert rejection is not None and rejection.impl == str(impl.id)
    return rejection.reason, rejection.detail


# --- LR2: each gate, its reason and the detail naming the value that failed -----------------------


def test_the_format_gate_names_both_formats():
    # RULES LR2
    assert rejected(TORCH_BF16, Problem("nvfp4"), Deployment(90)) == (Reason.QUANT_UNSUPPORTED, "serves bf16, the layer runs nvfp4")


def test_the_sm_gate_names_the_sm_and_the_supported_ones():
    # RULES LR2, ID3
    assert rejected(TORCH_BF16, Problem("bf16"), Deployment(80)) == (
        Reason.SM_UNSUPPORTED,
        "sm_80 is not among sm_90, sm_100, sm_103, sm_107, sm_110, sm_120, sm_121",
    )


def test_the_activation_gate_names_the_activation_and_the_supported_ones():
    # RULES LR2
    assert rejected(CUPY_BF16, Problem("bf16", activation="relu2"), Deployment(100)) == (
        Reason.ACTIVATION_UNSUPPORTED,
        "relu2 is not among silu_glu",
    )


def test_the_bias_gate_turns_down_biased_experts():
    # RULES LR2
    assert rejected(CUPY_BF16, Problem("bf16", expert_bias=True), Deployment(100)) == (Reason.BIAS_UNSUPPORTED, "the experts have biases")


@pytest.mark.parametrize(
    "impl, problem, deployment, detail",
    [
        (CUPY_BF16, Problem("bf16"), Deployment(100, moe_tp=2), "MoE tensor parallel moetp2 is not supported"),
        (TORCH_BF16, Problem("bf16", num_experts=8), Deployment(100, moe_tp=1, ep=3), "8 experts do not split over ep3"),
        (TORCH_BF16, Problem("bf16", intermediate_size=512), Deployment(100, moe_tp=3), "intermediate size 512 does not split over moetp3"),
    ],
)
def test_the_topology_gate_names_the_split_that_fails(impl, problem, deployment, detail):
    # RULES LR2
    assert rejected(impl, problem, deployment) == (Reason.TOPOLOGY_UNSUPPORTED, detail)


def test_the_topology_gate_turns_down_expert_parallel_where_it_is_not_a_capability():
    # RULES LR2
    registry = load_registry_text(small_registry_text(impl_toml("cupy.mma.k.bf16", "TORCH", 1, expert_parallel="false")))
    assert rejected(registry.impl("cupy.mma.k.bf16"), Problem("bf16"), Deployment(90, ep=4)) == (
        Reason.TOPOLOGY_UNSUPPORTED,
        "expert parallel ep4 is not supported",
    )


def test_the_shape_gate_names_the_size_and_the_multiple():
    # RULES LR2
    assert rejected(CUPY_BF16, Problem("bf16", hidden_size=1000), Deployment(100)) == (
        Reason.SHAPE_UNALIGNED,
        "hidden size 1000 is not a multiple of 128",
    )
    assert rejected(TORCH_FP8, Problem("fp8_block_scales", intermediate_size=512), Deployment(100, moe_tp=8)) == (
        Reason.SHAPE_UNALIGNED,
        "intermediate shard 64 (moetp8) is not a multiple of 128",
    )


def test_the_eplb_gate_turns_down_implementations_that_do_not_consume_plans():
    # RULES LR2, RQ4
    assert rejected(EAGER_BF16, Problem("bf16"), Deployment(90, eplb=True)) == (
        Reason.EPLB_UNSUPPORTED,
        "does not consume per-layer dynamic EPLB plans",
    )
    assert eligibility(TORCH_BF16, Problem("bf16"), Deployment(90, eplb=True)) is None


def test_a_candidate_outside_the_honored_set_is_turned_down_not_honored():
    # RULES LR2, TG4
    request = moe_impl_request("AUTO", field="moe_config.backend")
    outcome = ask_candidates(request, Problem("bf16"), Deployment(90), honored=frozenset({"torch.eager.loop.bf16"}))
    assert str(outcome.winner.id) == "torch.eager.loop.bf16"
    assert [r.describe() for r in outcome.rejections] == [
        "triton.wgmma.grouped_gemm.bf16: NOT_HONORED (the target honors only torch.eager.loop.bf16)",
        "cupy.mma.grouped_gemm.bf16: NOT_HONORED (the target honors only torch.eager.loop.bf16)",
        "torch.grouped_mm.grouped_gemm.bf16: NOT_HONORED (the target honors only torch.eager.loop.bf16)",
    ]


def test_the_reasons_are_a_closed_set_holding_every_reason_the_rules_name():
    # RULES LR2
    named = {
        "QUANT_UNSUPPORTED",
        "SM_UNSUPPORTED",
        "DTYPE_UNSUPPORTED",
        "SHAPE_UNALIGNED",
        "ACTIVATION_UNSUPPORTED",
        "BIAS_UNSUPPORTED",
        "TOPOLOGY_UNSUPPORTED",
        "EPLB_UNSUPPORTED",
        "NOT_HONORED",
    }
    assert named <= {r.value for r in Reason}
    with pytest.raises(ValueError):
        Reason("PROBABLY_FINE")


def test_a_rejection_requires_a_detail():
    # RULES LR2
    with pytest.raises(ValueError) as info:
        Rejection("torch.eager.loop.bf16", Reason.SM_UNSUPPORTED, "")
    assert str(info.value) == "a rejection needs a detail naming the value that failed (RULES LR2)"
    assert Rejection("x", Reason.SM_UNSUPPORTED, "sm_75").describe() == "x: SM_UNSUPPORTED (sm_75)"


# --- LR1: pure gates, the SM is an input, unknown is not false --------------------------------------


def test_the_format_gate_runs_first_so_a_foreign_format_is_never_described_by_its_sm():
    # RULES LR1, LR2
    assert rejected(CUPY_BF16, Problem("nvfp4"), Deployment(80)) == (Reason.QUANT_UNSUPPORTED, "serves bf16, the layer runs nvfp4")


def test_unknown_facts_make_their_gates_abstain():
    # RULES LR1: unknown is not false; only the facts given can reject.
    assert eligibility(CUPY_BF16, Problem("bf16"), Deployment(100, moe_tp=1)) is None
    assert eligibility(CUPY_BF16, Problem("bf16", activation=None, expert_bias=None, hidden_size=None), Deployment(100)) is None
    # the same facts, known and failing, reject
    assert eligibility(CUPY_BF16, Problem("bf16", expert_bias=True), Deployment(100)) is not None
    # known and passing
    assert eligibility(CUPY_BF16, Problem("bf16", activation="silu_glu", expert_bias=False, hidden_size=1024, intermediate_size=512, num_experts=8), Deployment(100)) is None


def test_the_sm_is_an_input_so_any_host_answers_for_any_gpu():
    # RULES LR1: the same call answers differently only because the SM argument differs.
    problem = Problem("bf16")
    assert eligibility(TORCH_BF16, problem, Deployment(90)) is None
    assert eligibility(TORCH_BF16, problem, Deployment(80)).reason is Reason.SM_UNSUPPORTED
    assert eligibility(TORCH_BF16, problem, Deployment(90)) == eligibility(TORCH_BF16, problem, Deployment(90))


def test_candidates_are_asked_in_priority_order_and_the_first_eligible_wins():
    # RULES LR1, RQ3
    request = moe_impl_request("AUTO", registry=C, field="moe_config.backend")
    outcome = ask_candidates(request, Problem("bf16", hidden_size=1024), Deployment(100))
    assert str(outcome.winner.id) == "cupy.mma.grouped_gemm.bf16"
    assert [str(i.id) for i in outcome.eligible] == [
        "cupy.mma.grouped_gemm.bf16",
        "torch.grouped_mm.grouped_gemm.bf16",
        "torch.eager.loop.bf16",
    ]
    # a gate that turns the first down hands the layer to the next in priority order
    outcome = ask_candidates(request, Problem("bf16", hidden_size=1000), Deployment(100))
    assert str(outcome.winner.id) == "torch.grouped_mm.grouped_gemm.bf16"
    assert [r.describe() for r in outcome.rejections] == [
        "cupy.mma.grouped_gemm.bf16: SHAPE_UNALIGNED (hidden size 1000 is not a multiple of 128)"
    ]


def test_only_candidates_of_the_layers_run_format_are_asked():
    # RULES LR1: other formats are not candidates for the layer at all (no QUANT_UNSUPPORTED noise).
    request = moe_impl_request("AUTO", field="moe_config.backend")
    outcome = ask_candidates(request, Problem("nvfp4"), Deployment(100))
    assert str(outcome.winner.id) == "torch.eager.loop.nvfp4"
    assert outcome.rejections == ()

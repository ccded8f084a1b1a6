"""`moe_impl_request`, the one conversion point from a selection to candidates (RULES RQ1-RQ4)."""

from __future__ import annotations

import pytest

from registry.errors import SelectionError, TacticError
from registry.impls import load_registry_text
from registry.resolve import moe_impl_request
from registry.tactics import parse_tactic
from tests.registry.helpers import cupy_registry, real_registry, small_registry_text

R = real_registry()
C = cupy_registry()

TORCH_IDS = [
    "torch.grouped_mm.grouped_gemm.bf16",
    "torch.grouped_mm.grouped_gemm.fp8_block_scales",
    "torch.grouped_mm.grouped_gemm.w4a16_mxfp4",
    "torch.grouped_mm.grouped_gemm.w4a16_nvfp4",
]
VANILLA_IDS = [
    "torch.eager.loop.bf16",
    "torch.eager.loop.fp8_block_scales",
    "torch.eager.loop.w4a16_mxfp4",
    "torch.eager.loop.w4a8_mxfp4_fp8",
    "torch.eager.loop.w4a8_mxfp4_mxfp8",
    "torch.eager.loop.w4a16_nvfp4",
    "torch.eager.loop.nvfp4",
]
CUPY_IDS = ["cupy.mma.grouped_gemm.bf16", "cupy.mma.grouped_gemm.nvfp4", "cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8"]


def cands(request) -> list[str]:
    return [str(i.id) for i in request.candidates]


# --- RQ1: literals -----------------------------------------------------------------------------------


def test_a_backend_literal_requests_its_backend_then_the_fallback_backend():
    # RULES RQ1
    request = moe_impl_request("CUPY", registry=C, field="moe_config.backend")
    assert cands(request) == CUPY_IDS + TORCH_IDS
    assert request.own == 3  # candidates[own:] are the fallback's
    assert (request.kind, request.requested, request.pinned) == ("backend", "CUPY", False)


def test_the_fallback_literal_is_the_fallback_itself():
    # RULES RQ1: TORCH requests TORCH, nothing after it.
    request = moe_impl_request("TORCH", registry=C, field="moe_config.backend")
    assert cands(request) == TORCH_IDS
    assert request.own == len(TORCH_IDS)


def test_vanilla_never_degrades():
    # RULES RQ1: VANILLA must not degrade, so no fallback follows it.
    request = moe_impl_request("VANILLA", registry=C, field="moe_config.backend")
    assert cands(request) == VANILLA_IDS
    assert request.own == len(VANILLA_IDS)


def test_an_unknown_literal_is_refused_with_the_list_of_literals():
    # RULES RQ1
    with pytest.raises(SelectionError) as info:
        moe_impl_request("CUTLASS", registry=C, field="moe_config.backend")
    assert str(info.value) == (
        "moe_config.backend 'CUTLASS' is not a backend literal; literals: AUTO, CUPY, TORCH, VANILLA "
        "(a tactic goes in the tactic field, in lower case) (RULES RQ1)"
    )


def test_a_literal_is_case_sensitive_and_stripped():
    # RULES RQ1: literals are upper case; surrounding blanks are not part of the value.
    assert moe_impl_request(" TORCH ", field="moe_config.backend").requested == "TORCH"
    with pytest.raises(SelectionError) as info:
        moe_impl_request("torch", field="speculative_config.moe_backend")
    assert str(info.value) == (
        "speculative_config.moe_backend 'torch' is not a backend literal; literals: AUTO, CUPY, TORCH, TRITON, VANILLA "
        "(a tactic goes in the tactic field, in lower case) (RULES RQ1)"
    )


# --- RQ2: tactics pin -----------------------------------------------------------------------------


def test_a_tactic_requests_exactly_its_matches_in_priority_order():
    # RULES RQ2
    request = moe_impl_request("bf16.grouped_gemm", registry=C, field="moe_config.tactic")
    assert cands(request) == ["cupy.mma.grouped_gemm.bf16", "torch.grouped_mm.grouped_gemm.bf16"]
    assert request.requested == "*.*.grouped_gemm.bf16"  # canonical


def test_a_pinned_tactic_never_falls_back():
    # RULES RQ2: own covers every candidate, so none is a fallback.
    request = moe_impl_request("cupy", registry=C, field="moe_config.tactic")
    assert request.pinned
    assert cands(request) == CUPY_IDS
    assert request.own == len(request.candidates)


def test_a_parsed_tactic_and_its_text_give_the_same_request():
    # RULES RQ2
    tactic = parse_tactic("eager.nvfp4", R)
    assert moe_impl_request(tactic) == moe_impl_request("eager.nvfp4", field="moe_config.tactic")


def test_without_a_field_an_upper_case_word_is_a_literal_and_anything_else_a_tactic():
    # RULES RQ1, RQ2 (the documented default when no config field is given)
    assert moe_impl_request("VANILLA").kind == "backend"
    assert moe_impl_request(" Eager.BF16 ").kind == "tactic"
    assert moe_impl_request(" Eager.BF16 ").tactic.text == "eager.bf16"


def test_the_field_decides_whether_a_value_is_a_literal_or_a_tactic():
    # RULES RQ1, RQ2
    assert moe_impl_request("nvfp4", field="speculative_config.moe_tactic").field == "speculative_config.moe_tactic"
    with pytest.raises(TacticError) as info:
        moe_impl_request("AUTO", field="moe_config.tactic")
    assert str(info.value) == (
        "moe_config.tactic 'auto': unknown segment 'auto'; known segments: provider cupy, torch, triton; technique eager, "
        "grouped_mm, mma, wgmma; kernel_name grouped_gemm, loop; quant bf16, fp8_block_scales, nvfp4, w4a16_mxfp4, "
        "w4a16_nvfp4, w4a8_mxfp4_fp8, w4a8_mxfp4_mxfp8 (RULES TA2)"
    )


# --- RQ3: AUTO ---------------------------------------------------------------------------------------


def test_auto_requests_every_implementation_in_priority_order_as_a_preference():
    # RULES RQ3
    request = moe_impl_request("AUTO", registry=C, field="moe_config.backend")
    assert cands(request) == [str(i.id) for i in C.impls]
    assert cands(request) == CUPY_IDS + TORCH_IDS + VANILLA_IDS
    assert request.own == len(request.candidates)  # nothing after AUTO: no fallback
    assert not request.pinned and request.kind == "auto" and request.requested == "AUTO"


# --- RQ4: dynamic EPLB -------------------------------------------------------------------------------


def test_auto_under_dynamic_eplb_considers_only_implementations_that_consume_eplb_plans():
    # RULES RQ4
    request = moe_impl_request("AUTO", eplb=True, registry=C, field="moe_config.backend")
    assert cands(request) == ["cupy.mma.grouped_gemm.nvfp4", "cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8"] + TORCH_IDS
    assert all(i.capabilities.dynamic_eplb for i in request.candidates)
    assert request.eplb


def test_a_literal_under_dynamic_eplb_keeps_only_its_consumers_then_the_fallbacks():
    # RULES RQ4
    request = moe_impl_request("CUPY", eplb=True, registry=C, field="moe_config.backend")
    assert cands(request) == ["cupy.mma.grouped_gemm.nvfp4", "cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8"] + TORCH_IDS
    assert request.own == 2


def test_a_literal_whose_backend_consumes_no_eplb_plans_is_refused():
    # RULES RQ4
    with pytest.raises(SelectionError) as info:
        moe_impl_request("VANILLA", eplb=True, registry=C, field="moe_config.backend")
    assert str(info.value) == (
        "moe_config.backend 'VANILLA' under dynamic EPLB: no VANILLA implementation consumes EPLB plans; "
        "backends that do: CUPY, TORCH (RULES RQ4)"
    )


def test_auto_under_dynamic_eplb_with_no_consumer_at_all_is_refused():
    # RULES RQ4
    registry = load_registry_text(small_registry_text().replace("dynamic_eplb = true", "dynamic_eplb = false"))
    with pytest.raises(SelectionError) as info:
        moe_impl_request("AUTO", eplb=True, registry=registry, field="moe_config.backend")
    assert str(info.value) == "moe_config.backend 'AUTO' under dynamic EPLB: no implementation consumes EPLB plans (RULES RQ4)"


def test_a_tactic_under_dynamic_eplb_must_match_an_implementation_that_consumes_plans():
    # RULES RQ4: refused when parsed, naming what it matches.
    with pytest.raises(TacticError) as info:
        moe_impl_request("mma.bf16", eplb=True, registry=C, field="moe_config.tactic")
    assert str(info.value) == (
        "moe_config.tactic 'mma.bf16' under dynamic EPLB names no implementation that consumes EPLB plans; "
        "it matches cupy.mma.grouped_gemm.bf16 (RULES RQ4)"
    )
    with pytest.raises(TacticError) as info:
        moe_impl_request("eager.nvfp4", eplb=True, field="speculative_config.moe_tactic")
    assert str(info.value) == (
        "speculative_config.moe_tactic 'eager.nvfp4' under dynamic EPLB names no implementation that consumes "
        "EPLB plans; it matches torch.eager.loop.nvfp4 (RULES RQ4)"
    )


def test_a_tactic_under_dynamic_eplb_matching_one_consumer_is_accepted():
    # RULES RQ4: non-consumers stay candidates and are turned down EPLB_UNSUPPORTED per layer.
    request = moe_impl_request("grouped_gemm.bf16", eplb=True, registry=C, field="moe_config.tactic")
    assert cands(request) == ["cupy.mma.grouped_gemm.bf16", "torch.grouped_mm.grouped_gemm.bf16"]
    assert request.pinned and request.eplb

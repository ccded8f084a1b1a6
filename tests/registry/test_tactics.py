"""Tactics: parse, canonical and compact forms, refusals, shortest queries, suggestions (RULES TA1-TA3)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from registry.errors import TacticError
from registry.identity import FIELDS
from registry.tactics import Tactic, matching_impls, parse_tactic, shortest_query, suggest
from tests.registry.helpers import cupy_registry, real_registry

R = real_registry()
ALL_IDS = [str(i.id) for i in R.impls]


def ids(tactic: Tactic, registry=R) -> list[str]:
    return [str(i.id) for i in matching_impls(tactic, registry)]


def refusal(text: str, field: str = "moe_config.tactic", registry=R) -> str:
    with pytest.raises(TacticError) as info:
        parse_tactic(text, registry, field)
    return str(info.value)


# --- TA1: 1-4 segments in any order, each finding its own field; '*' is a wildcard ---------------


@pytest.mark.parametrize(
    "spelling",
    [
        "grouped_mm.bf16",
        "bf16.grouped_mm",
        "torch.grouped_mm.*.bf16",
        "*.bf16.*.grouped_mm",
        "  GROUPED_MM.Bf16  ",
        "bf16.grouped_gemm.torch.grouped_mm",
    ],
)
def test_a_tactic_names_the_same_implementations_in_any_order_case_or_padding(spelling):
    # RULES TA1
    tactic = parse_tactic(spelling, R)
    assert ids(tactic) == ["torch.grouped_mm.grouped_gemm.bf16"]
    assert tactic.quant == "bf16" and tactic.technique == "grouped_mm"


def test_a_tactic_is_stored_stripped_and_lowercased():
    # RULES TA1
    assert parse_tactic("  Eager.NVFP4 ", R).text == "eager.nvfp4"


def test_the_canonical_form_is_full_width_in_field_order_and_the_compact_form_drops_wildcards():
    # RULES TA1
    tactic = parse_tactic("bf16.*.eager", R)
    assert tactic.canonical == "*.eager.*.bf16"
    assert tactic.compact == "eager.bf16"
    assert tactic.pinned() == {"technique": "eager", "quant": "bf16"}
    assert parse_tactic("eager.bf16", R).canonical == parse_tactic("*.eager.*.bf16", R).canonical


def test_each_token_finds_its_own_field():
    # RULES TA1, ID2
    tactic = parse_tactic("loop.torch", R)
    assert (tactic.provider, tactic.technique, tactic.kernel_name, tactic.quant) == ("torch", None, "loop", None)


def test_a_one_segment_tactic_names_every_implementation_with_that_token_in_priority_order():
    # RULES TA1, RQ2
    assert ids(parse_tactic("bf16", R)) == ["triton.wgmma.grouped_gemm.bf16", "cupy.mma.grouped_gemm.bf16",
                                            "torch.grouped_mm.grouped_gemm.bf16", "torch.eager.loop.bf16"]
    assert ids(parse_tactic("torch", R)) == [i for i in ALL_IDS if i.startswith("torch.")]


def test_a_full_id_is_a_tactic_naming_exactly_that_implementation():
    # RULES TA1
    for impl_id in ALL_IDS:
        assert ids(parse_tactic(impl_id, R)) == [impl_id]


def test_every_registered_token_alone_is_a_valid_tactic():
    # RULES TA1
    for token, field in R.token_field.items():
        tactic = parse_tactic(token, R)
        assert tactic.pinned() == {field: token}


# --- TA2: every refusal, with its message ----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\t\n"])
def test_an_empty_tactic_is_refused_with_an_example(text):
    # RULES TA2
    assert refusal(text) == (
        "moe_config.tactic is empty: name at least one segment of provider.technique.kernel_name.quant, "
        "e.g. 'triton.bf16' (RULES TA2)"
    )


@pytest.mark.parametrize(
    "text, position",
    [(".", 1), ("bf16.", 2), (".bf16", 1), ("eager..bf16", 2)],
)
def test_an_empty_segment_is_refused_with_its_position(text, position):
    # RULES TA2
    assert refusal(text) == (
        f"moe_config.tactic {text!r} has an empty segment at position {position}: separate segments with "
        "single dots (RULES TA2)"
    )


def test_more_than_four_segments_are_refused():
    # RULES TA2
    assert refusal("torch.eager.loop.bf16.x") == (
        "moe_config.tactic 'torch.eager.loop.bf16.x' has 5 segments; a tactic has at most 4, one for each field "
        "of provider.technique.kernel_name.quant (RULES TA2)"
    )


def test_an_unknown_token_is_refused_with_the_closest_known_tokens():
    # RULES TA2: did you mean
    assert refusal("grouped_mn") == (
        "moe_config.tactic 'grouped_mn': unknown segment 'grouped_mn'; did you mean 'grouped_mm' or "
        "'grouped_gemm'? (RULES TA2)"
    )
    assert refusal("eager.bf61") == "moe_config.tactic 'eager.bf61': unknown segment 'bf61'; did you mean 'bf16'? (RULES TA2)"


def test_an_unknown_token_with_nothing_close_lists_the_known_tokens_per_field():
    # RULES TA2
    assert refusal("xyzzy") == (
        "moe_config.tactic 'xyzzy': unknown segment 'xyzzy'; known segments: provider cupy, torch, triton; technique eager, "
        "grouped_mm, mma, wgmma; kernel_name grouped_gemm, loop; quant bf16, fp8_block_scales, nvfp4, w4a16_mxfp4, "
        "w4a16_nvfp4, w4a8_mxfp4_fp8, w4a8_mxfp4_mxfp8 (RULES TA2)"
    )


def test_suggestions_are_at_most_three_close_tokens():
    # RULES TA2
    assert suggest("grouped", R) == ["grouped_mm", "grouped_gemm"]
    assert suggest("nvfp", R) == ["nvfp4"]
    assert set(suggest("w4a8_mxfp4", R)) == {"w4a16_mxfp4", "w4a8_mxfp4_fp8", "w4a8_mxfp4_mxfp8"}
    assert len(suggest("w4a", R)) <= 3
    assert suggest("vanilla", R) == []


def test_a_field_set_twice_is_refused():
    # RULES TA2
    assert refusal("bf16.nvfp4") == (
        "moe_config.tactic 'bf16.nvfp4': 'bf16' and 'nvfp4' both name the quant; name each field at most once (RULES TA2)"
    )


@pytest.mark.parametrize("text", ["*", "*.*", "*.*.*.*"])
def test_a_wildcard_only_tactic_is_refused(text):
    # RULES TA2
    assert refusal(text) == f"moe_config.tactic {text!r} constrains no field: name at least one segment besides '*' (RULES TA2)"


def test_a_tactic_matching_nothing_is_refused_with_what_each_dropped_segment_would_match():
    # RULES TA2
    assert refusal("grouped_mm.nvfp4") == (
        "moe_config.tactic 'grouped_mm.nvfp4' matches no registered implementation; without 'grouped_mm': "
        "torch.eager.loop.nvfp4; without 'nvfp4': torch.grouped_mm.grouped_gemm.bf16, "
        "torch.grouped_mm.grouped_gemm.fp8_block_scales, torch.grouped_mm.grouped_gemm.w4a16_mxfp4, "
        "torch.grouped_mm.grouped_gemm.w4a16_nvfp4 (RULES TA2)"
    )
    assert refusal("torch.eager.grouped_gemm.bf16") == (
        "moe_config.tactic 'torch.eager.grouped_gemm.bf16' matches no registered implementation; without 'eager': "
        "torch.grouped_mm.grouped_gemm.bf16; without 'grouped_gemm': torch.eager.loop.bf16 (RULES TA2)"
    )


def test_a_refusal_names_the_field_that_set_the_tactic():
    # RULES TA2, LR3: the draft field is named for draft tactics.
    assert refusal("bf61", field="speculative_config.moe_tactic") == (
        "speculative_config.moe_tactic 'bf61': unknown segment 'bf61'; did you mean 'bf16'? (RULES TA2)"
    )


def test_refusals_happen_at_parse_time_from_the_registry_alone():
    # RULES TA2: parse_tactic needs only the registry (no model, no checkpoint); refused before loading.
    with pytest.raises(TacticError):
        parse_tactic("cutlass", R)
    assert ids(parse_tactic("cupy", cupy_registry()), cupy_registry()) == [
        "cupy.mma.grouped_gemm.bf16",
        "cupy.mma.grouped_gemm.nvfp4",
        "cupy.mma.grouped_gemm.w4a8_mxfp4_mxfp8",
    ]


# --- TA3: shortest_query --------------------------------------------------------------------------


def test_every_registered_id_has_a_shortest_query_that_matches_exactly_that_id():
    # RULES TA3
    for registry in (R, cupy_registry()):
        for impl in registry.impls:
            query = shortest_query(impl.id, registry)
            assert ids(parse_tactic(query, registry), registry) == [str(impl.id)]
            # no tactic with fewer segments matches exactly this id
            for fewer in range(1, len(query.split("."))):
                for fields in itertools.combinations(FIELDS, fewer):
                    narrower = Tactic("", **{f: impl.id.segment(f) for f in fields})
                    assert ids(narrower, registry) != [str(impl.id)]


def test_the_shortest_queries_of_the_project_registry():
    # RULES TA3: ties go to the canonical field order (technique before kernel_name), then lexicographic.
    assert {str(i.id): shortest_query(i.id, R) for i in R.impls} == {
        "cupy.mma.grouped_gemm.bf16": "cupy.bf16",
        "cupy.mma.grouped_gemm.fp8_block_scales": "cupy.fp8_block_scales",
        "cupy.mma.grouped_gemm.w4a16_mxfp4": "cupy.w4a16_mxfp4",
        "cupy.mma.grouped_gemm.w4a8_mxfp4_fp8": "cupy.w4a8_mxfp4_fp8",
        "cupy.mma.grouped_gemm.w4a16_nvfp4": "cupy.w4a16_nvfp4",
        "triton.wgmma.grouped_gemm.bf16": "triton.bf16",
        "triton.wgmma.grouped_gemm.fp8_block_scales": "triton.fp8_block_scales",
        "triton.wgmma.grouped_gemm.w4a16_mxfp4": "triton.w4a16_mxfp4",
        "triton.wgmma.grouped_gemm.w4a16_nvfp4": "triton.w4a16_nvfp4",
        "triton.wgmma.grouped_gemm.w4a8_mxfp4_fp8": "triton.w4a8_mxfp4_fp8",
        "torch.grouped_mm.grouped_gemm.bf16": "grouped_mm.bf16",
        "torch.grouped_mm.grouped_gemm.fp8_block_scales": "grouped_mm.fp8_block_scales",
        "torch.grouped_mm.grouped_gemm.w4a16_mxfp4": "grouped_mm.w4a16_mxfp4",
        "torch.grouped_mm.grouped_gemm.w4a16_nvfp4": "grouped_mm.w4a16_nvfp4",
        "torch.eager.loop.bf16": "eager.bf16",
        "torch.eager.loop.fp8_block_scales": "eager.fp8_block_scales",
        "torch.eager.loop.w4a16_mxfp4": "eager.w4a16_mxfp4",
        "torch.eager.loop.w4a8_mxfp4_fp8": "torch.w4a8_mxfp4_fp8",
        "torch.eager.loop.w4a8_mxfp4_mxfp8": "w4a8_mxfp4_mxfp8",
        "torch.eager.loop.w4a16_nvfp4": "eager.w4a16_nvfp4",
        "torch.eager.loop.nvfp4": "nvfp4",
    }


def test_the_shortest_query_tie_breaks_on_field_order_then_text():
    # RULES TA3: with CUPY, 'cupy.bf16' and 'mma.bf16' both match exactly this id with two segments;
    # provider comes before technique in field order.
    assert shortest_query("cupy.mma.grouped_gemm.bf16", cupy_registry()) == "cupy.bf16"


def test_shortest_query_of_an_unregistered_id_is_refused():
    # RULES TA3
    with pytest.raises(TacticError) as info:
        shortest_query("torch.eager.grouped_gemm.w4a16_mxfp4", R)
    assert str(info.value) == "torch.eager.grouped_gemm.w4a16_mxfp4 is not a registered implementation id"


# --- property: arbitrary strings give a canonical tactic or the project's own error -----------------

_TOKENS = sorted(R.token_field) + ["*", "cupy", "bf61", "grouped", ""]


@st.composite
def tactic_like(draw):
    """Strings built from known tokens, dots, stars, case changes and whitespace."""
    parts = draw(st.lists(st.sampled_from(_TOKENS), min_size=0, max_size=6))
    parts = [p.upper() if draw(st.booleans()) else p for p in parts]
    sep = draw(st.sampled_from([".", ".", ".", "..", " . ", ",", ""]))
    pad = draw(st.sampled_from(["", " ", "\t", "\n ", "\u00a0"]))
    return pad + sep.join(parts) + pad


def _check(text: str) -> None:
    try:
        tactic = parse_tactic(text, R)
    except TacticError:
        return
    assert isinstance(tactic, Tactic)
    assert tactic.text == text.strip().lower()
    matches = ids(tactic)
    assert matches
    for spelling in (tactic.canonical, tactic.compact, tactic.text):
        again = parse_tactic(spelling, R)
        assert again.canonical == tactic.canonical
        assert ids(again) == matches


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_any_string_gives_a_canonical_tactic_or_a_tactic_error(text):
    # RULES TA1, TA2
    _check(text)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tactic_like())
def test_any_string_of_known_tokens_dots_stars_and_spaces_gives_a_canonical_tactic_or_a_tactic_error(text):
    # RULES TA1, TA2
    _check(text)

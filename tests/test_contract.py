"""The shared value types (`contract.py`): the tri-state honored ids, the parallel layout and its names, the MoE layer shape."""

from __future__ import annotations

import pytest

from contract import ANY, ContractError, Honored, Layout, MoeShape, layout_grammar, parse_layout


@pytest.mark.parametrize("value", [None, "*", ["b.x.y.bf16", "a.x.y.bf16"], ("a.x.y.bf16",), []])
def test_honored_round_trips_through_its_literal(value):
    # RULES TG2: a declaration's value, the plan/index literal and the value read back are one state
    honored = Honored.parse(value)
    assert Honored.parse(honored.literal()) == honored
    expected = value if value is None or value == ANY else tuple(sorted(value))
    assert honored.literal() == expected


def test_honored_states_restrict_allow_and_describe():
    # RULES TG2 (left out: no tactic), TG3 (allows), TG4 (a list restricts the winner)
    nothing, anything = Honored.parse(None), Honored.parse("*")
    listed, empty = Honored.parse(["b.x.y.bf16", "a.x.y.bf16"]), Honored.parse([])
    assert [h.declared for h in (nothing, anything, listed, empty)] == [False, True, True, True]
    assert [h.restricts for h in (nothing, anything, listed, empty)] == [None, None, frozenset({"a.x.y.bf16", "b.x.y.bf16"}), frozenset()]
    assert [h.allows("a.x.y.bf16") for h in (nothing, anything, listed, empty)] == [False, True, True, False]
    assert listed.allows("c.x.y.bf16") is False
    assert [h.describe() for h in (nothing, anything, listed, empty)] == [
        "no tactic (it declares no honored ids)", "any implementation", "only a.x.y.bf16, b.x.y.bf16", "no implementation"]


@pytest.mark.parametrize("value", ["all", 3, ["a", 1], {"a": 1}])
def test_honored_refuses_other_shapes(value):
    with pytest.raises(ContractError) as err:
        Honored.parse(value)
    assert str(err.value) == f'{value!r} is not a list of implementation ids, "*" (any) or left out (honors none) (RULES TG2)'


def test_honored_is_a_list_or_any_not_both():
    with pytest.raises(ContractError) as err:
        Honored(frozenset({"a"}), wildcard=True)
    assert str(err.value) == 'Honored is either a list of ids or any id ("*"), not both'


def test_parallel_names_parse_to_layouts():
    # RULES TG1: the parallel token is part of the target's identity
    assert parse_layout("tp4") == Layout(tp=4, moe_tp=4, ep=1, dp=1)
    assert parse_layout("tp16_moetp4ep4") == Layout(tp=16, moe_tp=4, ep=4, dp=1)
    assert parse_layout("dep8") == Layout(tp=1, moe_tp=1, ep=8, dp=8)
    profile = Layout(tp=2, moe_tp=1, ep=4, dp=2)
    assert parse_layout("low_latency", {"low_latency": profile}) is profile
    assert [layout_grammar(n) for n in ("tp2", "tp2_moetp1ep2", "dep2", "low_latency", "tp0", "tp2_moetp2")] == [
        True, True, True, False, False, False]


def test_parallel_names_that_are_no_layout_are_refused_naming_the_fix():
    with pytest.raises(ContractError) as err:
        parse_layout("tp8_moetp2ep2")
    assert str(err.value) == ("parallel layout 'tp8_moetp2ep2': moetp2 x ep2 = 4 ranks, but tp8 has 8; "
                              "the MoE split must cover the same ranks as attention")
    with pytest.raises(ContractError) as err:
        parse_layout("fast", {"low_latency": Layout()})
    assert str(err.value) == ("parallel layout 'fast' is not tp<N>, tp<N>_moetp<X>ep<Y>, dep<N> or a declared profile "
                              "(this model's profiles: low_latency)")


def test_layout_rank_helpers_follow_the_documented_numbering():
    # docs/runtime.md: tp_rank = r % tp, dp_rank = r // tp; ep_rank = r // moe_tp, moe_tp_rank = r % moe_tp
    layout = Layout(tp=2, moe_tp=2, ep=2, dp=2)
    assert [(layout.tp_rank(r), layout.dp_rank(r), layout.ep_rank(r), layout.moe_tp_rank(r)) for r in range(4)] == [
        (0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 1, 0), (1, 1, 1, 1)]
    assert layout.tp_group_ranks(1) == (2, 3) and layout.dp_group_ranks(1) == (1, 3)
    with pytest.raises(ContractError) as err:
        layout.tp_rank(4)
    assert str(err.value) == "rank 4 is outside this layout's world of 4"
    with pytest.raises(ContractError) as err:
        Layout(tp=2, moe_tp=1, ep=1)
    assert str(err.value) == "Layout(tp=2, moe_tp=1, ep=1, dp=1): moe_tp * ep = 1 must equal world = tp * dp = 2"


def test_moe_shape_is_checked_and_knows_its_projections():
    assert MoeShape(64, 32, 4, 2, "silu_glu").projections == ("gate", "up", "down")
    assert MoeShape(64, 32, 4, 2, "relu2").projections == ("up", "down")
    assert MoeShape(64, 32, 4, 2, "swiglu_oai", True).gated
    for args, message in (((64, 0, 4, 2, "silu_glu"), "MoeShape.intermediate_size must be positive, got 0"),
                          ((64, 32, 4, 5, "silu_glu"), "MoeShape.top_k 5 exceeds num_experts 4"),
                          ((64, 32, 4, 2, "gelu"), "unknown expert activation 'gelu'; known: silu_glu, swiglu_oai, relu2")):
        with pytest.raises(ContractError) as err:
            MoeShape(*args)
        assert str(err.value) == message

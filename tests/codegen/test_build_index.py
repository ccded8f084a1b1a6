"""The build index over a generated index (`registry/build_index.py` + `_build_index.py`; RULES TG5, TG6).

A specialized build serves only a selection it claims *and* resolves to what it was built with;
anything else goes to the generic build under `auto`, fails naming the criterion under `require`,
and `off` always takes the generic build. The index is the one the generator renders, read back as
`registry/build_index.py` reads it (no torch: the build index is pure).
"""

from __future__ import annotations

import pytest

from codegen.outputs import index_outputs
from codegen.plan import target_plan
from contract import Layout
from registry.build_index import pick_build
from registry.declarations import find_model, load_models
from registry.errors import NotHonoredError, SelectionError
from registry.model import facts_from_literal, facts_to_literal
from registry.selection import Selection
from tests.codegen.helpers import EAGER_BF16, GROUPED_BF16, MYMOE, ROOT, write_models

TP1, TP2 = "mymoe_bf16__sm_90__tp1", "mymoe_bf16__sm_90__tp2"
GENERIC = ".mymoe.generic.modeling"
EAGER_REFUSAL = (
    f"{TP1}: moe_config.tactic 'eager' resolves to {EAGER_BF16} for the routed layers 0-1 (format bf16 on sm_90); "
    f"this target honors only {GROUPED_BF16} (RULES TG3)"
)


@pytest.fixture(scope="module")
def mymoe(tmp_path_factory):
    """(index, facts) of the user model: the rendered _build_index.py, executed as Python."""
    decl = find_model("mymoe", load_models(write_models(tmp_path_factory.mktemp("models"), mymoe=MYMOE)))
    plans = [target_plan(decl, t)[0] for t in decl.targets]
    text = next(o.content for o in index_outputs(["mymoe"], plans) if o.path == "_build_index.py")
    namespace: dict = {}
    exec(compile(text, "_build_index.py", "exec"), namespace)
    return namespace["INDEX"], decl.facts()


def go(mymoe, parallel="tp1", sm=90, mode="auto", **selection):
    index, facts = mymoe
    layout = {"tp1": Layout(1, 1, 1, 1), "tp2": Layout(2, 2, 1, 1)}[parallel]
    return pick_build(index, facts, sm, parallel, layout, Selection(**selection), mode)


def test_the_declared_selection_routes_to_the_specialized_build(mymoe):
    # RULES TG6: key (model, checkpoint, sm, parallel)
    chosen = go(mymoe)
    assert (chosen.kind, chosen.target, chosen.module, chosen.reasons) == ("specialized", TP1, f".mymoe.{TP1}.modeling", ())
    assert chosen.resolution.bound_ids() == (GROUPED_BF16,)


def test_a_tactic_the_target_does_not_honor_goes_generic_under_auto_naming_why(mymoe):
    # RULES TG5
    chosen = go(mymoe, tactic="eager")
    assert (chosen.kind, chosen.target, chosen.module, chosen.reasons) == ("generic", None, GENERIC, (EAGER_REFUSAL,))
    assert chosen.resolution.bound_ids() == (EAGER_BF16,)   # what the generic build will bind


def test_under_require_the_same_refusal_is_an_error_naming_the_criterion(mymoe):
    # RULES TG5
    with pytest.raises(NotHonoredError) as err:
        go(mymoe, tactic="eager", mode="require")
    assert str(err.value) == f"mode require: no specialized build serves this deployment: {EAGER_REFUSAL} (RULES TG5)"


def test_mode_off_always_takes_the_generic_build(mymoe):
    # RULES TG5
    chosen = go(mymoe, mode="off")
    assert (chosen.kind, chosen.module, chosen.reasons) == ("generic", GENERIC, ("mode off: always the generic build",))


def test_a_target_that_claims_but_is_bound_to_something_else_is_not_used(mymoe):
    # RULES TG5: tp2 honors any id, so it claims the tactic, but its build binds the grouped GEMM
    expected = (
        f"{TP2}: built with {GROUPED_BF16} for layers 0-1; this selection resolves to {EAGER_BF16} for layers 0-1",
    )
    for selection in ({"tactic": "eager"}, {"backend": "VANILLA"}):
        chosen = go(mymoe, parallel="tp2", **selection)
        assert (chosen.kind, chosen.module, chosen.reasons) == ("generic", GENERIC, expected)
    with pytest.raises(NotHonoredError) as err:
        go(mymoe, parallel="tp2", tactic="eager", mode="require")
    assert str(err.value) == f"mode require: no specialized build serves this deployment: {expected[0]} (RULES TG5)"
    # ... while a pin of exactly what it binds is served by it
    assert go(mymoe, parallel="tp2", tactic="grouped_mm").target == TP2


def test_no_declared_target_for_the_key_goes_generic_naming_the_declared_ones(mymoe):
    # RULES TG6
    chosen = go(mymoe, sm=100)
    assert chosen.reasons == (
        f"no target of mymoe is declared for checkpoint mymoe_bf16 on sm_100 with parallel tp1 (declared: {TP1}, {TP2})",
    )
    with pytest.raises(NotHonoredError):
        go(mymoe, sm=100, mode="require")


def test_a_speculative_mode_the_model_has_no_draft_for_is_refused_naming_its_drafts(mymoe):
    # RULES DR1: no build of any kind can serve it, so it is an error under every mode
    with pytest.raises(SelectionError) as err:
        go(mymoe, spec_mode="mtp")
    assert str(err.value) == "mymoe has no draft for speculative_config.mode 'mtp'; its drafts serve: none"


def test_an_unknown_mode_is_refused(mymoe):
    with pytest.raises(SelectionError) as err:
        go(mymoe, mode="sometimes")
    assert str(err.value) == "mode 'sometimes' is not one of auto, require, off"


def test_the_checked_in_index_routes_each_declared_target_to_its_own_build(project):
    # RULES TG6 on the repo's generated/_build_index.py and facts literals
    import importlib

    decls, registry, plans = project
    index = importlib.import_module("generated._build_index").INDEX
    for model, (_, targets) in plans.items():
        facts_module = importlib.import_module(f"generated.{model}.facts")
        for planned in targets:
            target, plan = planned.target, planned.plan
            facts = facts_from_literal(facts_module.FACTS[target.checkpoint])
            assert facts_to_literal(facts) == facts_module.FACTS[target.checkpoint]
            chosen = pick_build(index, facts, target.sm, target.parallel, Layout(*plan.layout), target.selection.selection())
            assert (chosen.kind, chosen.target) == ("specialized", target.name), chosen.reasons
    assert (ROOT / "generated" / "_build_index.py").is_file()

"""The build fingerprint: sha256 of what a file is rendered from, the canonical plan (RULES GN2).

Equivalent spellings of a tactic are one selection, so they give one plan, one fingerprint and the
same bytes on disk; a different selection gives a different fingerprint; an implementation added to
the registry changes no file of a build that does not bind it but the reports that list it.
"""

from __future__ import annotations

import pytest

from codegen.plan import generic_plan, target_plan
from registry.declarations import find_model, load_models
from registry.selection import Selection
from tests.codegen.helpers import MYMOE, ROOT, cli, files, write_models

SPELLINGS = ("torch.eager", "Eager.TORCH", " *.eager.torch \t", "torch.eager.*.*", "eager.*.torch")


@pytest.fixture(scope="module")
def mymoe(tmp_path_factory):
    folder = write_models(tmp_path_factory.mktemp("models"), mymoe=MYMOE)
    return folder, find_model("mymoe", load_models(folder))


def test_equivalent_spellings_give_one_fingerprint_even_in_a_refused_plan(mymoe):
    # RULES GN2, TA1: the refusal text a plan records reads the canonical spelling, not the user's
    _, decl = mymoe
    for target in decl.targets:
        plans = [target_plan(decl, target, Selection(tactic=s))[0] for s in SPELLINGS]
        assert len({p.fingerprint for p in plans}) == 1
        assert len({p.canonical() for p in plans}) == 1
    generics = {generic_plan(decl, Selection(tactic=s)).fingerprint for s in SPELLINGS}
    assert len(generics) == 1


def test_equivalent_spellings_write_byte_identical_trees(mymoe, capsys, tmp_path):
    # RULES GN2: the header names the canonical selection and the --models folder, never the spelling or the --out folder
    folder, _ = mymoe
    trees = []
    for n, spelling in enumerate(SPELLINGS):
        out = tmp_path / str(n)
        code, _, err = cli(capsys, "generate", "--models", folder, "--model", "mymoe", "--tactic", spelling, "--out", out)
        assert (code, err) == (0, "")
        trees.append(files(out))
    assert all(tree == trees[0] for tree in trees)
    header = trees[0]["mymoe/generic/modeling.py"].decode().splitlines()[1]
    assert header == f"# Regenerate: python -m codegen generate --model mymoe --models {folder} --tactic torch.eager"


def test_a_different_selection_gives_a_different_fingerprint(mymoe):
    # RULES GN2: the fingerprint changes exactly when the plan does
    _, decl = mymoe
    target = next(t for t in decl.targets if t.parallel == "tp2")   # honors any id: every selection builds
    selections = [Selection(), Selection(tactic="eager"), Selection(tactic="grouped_mm"), Selection(backend="VANILLA"), Selection(backend="TORCH")]
    plans = [target_plan(decl, target, s)[0] for s in selections]
    assert len({p.fingerprint for p in plans}) == len(selections)
    # backend TORCH and the pinned grouped GEMM bind the same class, and still differ: the selection is in the plan
    assert plans[2].bound_ids == plans[4].bound_ids


def test_the_fingerprint_is_stable_across_calls_and_matches_the_header(mymoe, capsys, tmp_path):
    # RULES GN2: the header carries the plan's fingerprint
    folder, decl = mymoe
    target = next(t for t in decl.targets if t.parallel == "tp1")
    plan, _ = target_plan(decl, target)
    assert plan.fingerprint == target_plan(decl, target)[0].fingerprint
    out = tmp_path / "o"
    assert cli(capsys, "generate", "--models", folder, "--model", "mymoe", "--parallel", "tp1", "--out", out)[0] == 0
    text = (out / f"mymoe/{target.name}/modeling.py").read_text()
    assert text.splitlines()[2] == f"# Fingerprint: {plan.fingerprint}"


def test_a_new_implementation_changes_only_the_reports_it_enters_and_no_build_that_does_not_bind_it(tmp_path):
    # RULES GN2, ARCHITECTURE "what a change costs": a new implementation leaves the bytes of every build
    # that does not bind it alone; only the resolution.json of the builds whose layers it is an
    # alternative or a rejection of lists it. Low priority on sm_100 only: it never wins over the TORCH grouped GEMM.
    from codegen.generate import declared_generation, project_models
    from registry.impls import load_registry, load_registry_text
    from tests.registry.helpers import REAL_TEXT, impl_toml

    new_id = "torch.grouped_mm.blocked_gemm.bf16"
    decls = project_models(load_models())
    before = load_registry()
    after = load_registry_text(REAL_TEXT + impl_toml(new_id, "TORCH", 599, sms="[100]", cpu="true",
                                                     klass="runtime.experts.torch_grouped:TorchBlockedBf16Experts"))
    old = {o.path: o.content for o in declared_generation(decls, before).roots["generated"]}
    new_generation = declared_generation(decls, after)
    new = {o.path: o.content for o in new_generation.roots["generated"]}
    assert set(new) == set(old)
    changed = sorted(p for p in new if new[p] != old[p])
    entered = sorted(p for p in new if p.endswith("/resolution.json") and new_id in new[p])
    assert entered, "the new implementation enters no build's resolution: the test proves nothing"
    assert changed == entered
    # Every build's Python files, the facts, the index and the shims stay byte-identical, among them the
    # modeling.py of the builds whose report now lists the new id.
    assert not [p for p in changed if p.endswith(".py")]
    unaffected = [p for p in new if p.endswith("/resolution.json") and p not in entered]
    assert unaffected, "every build's resolution lists the new implementation: nothing shows a build left alone"


def test_the_generic_draft_fingerprint_covers_the_declared_draft_name_and_kind(capsys, tmp_path):
    # RULES GN2: the generic draft.py names its declared draft and reads its kind (which tensors it skips);
    # renaming the draft or changing its kind changes that file's text, so it must change its fingerprint too,
    # and leaves the generic modeling.py (which reads neither) byte-identical.
    source = (ROOT / "registry" / "models" / "tiny_deepseek_v3.toml").read_text(encoding="utf-8")
    # Its first target, under a name of the user's own (a --models model may not shadow a project one).
    source = source[: source.index("[[targets]]", source.index("[[targets]]") + 1)].replace("tiny_deepseek_v3", "mtpmoe")
    renamed = source.replace('name = "mtpmoe_mtp"', 'name = "mtpmoe_nextn"')
    replaced = source.replace('kind = "embedded_mtp"', 'kind = "replacement_mtp"\nnum_layers = 1\n'
                              'checkpoint = { name = "own_head_bf16" }')
    assert len({source, renamed, replaced}) == 3
    trees = []
    for n, text in enumerate((source, renamed, replaced)):
        folder = write_models(tmp_path / "models", mtpmoe=text)   # one folder: the header names it
        out = tmp_path / f"out{n}"
        code, _, err = cli(capsys, "generate", "--models", folder, "--model", "mtpmoe", "--out", out)
        assert (code, err) == (0, "")
        trees.append(files(out))
    drafts = [tree["mtpmoe/generic/draft.py"].decode() for tree in trees]
    assert len(set(drafts)) == 3
    prints = [text.splitlines()[2] for text in drafts]
    assert all(p.startswith("# Fingerprint: sha256:") for p in prints)
    assert len(set(prints)) == 3, prints
    assert len({tree["mtpmoe/generic/modeling.py"] for tree in trees[:2]}) == 1

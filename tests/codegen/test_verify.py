"""The libcst claims (RULES GN1, GN4): what a build file may import and which constants it must declare.

The checked-in tree satisfies them; each claim, broken on purpose in a rendered file, is refused with
the file, the line and the claim named.
"""

from __future__ import annotations

import pytest

from codegen.errors import GenerationError
from codegen.modeling import render_draft, render_generic, render_modeling
from codegen.verify import DATA_CLAIMS, GENERIC_CLAIMS, claims_for_draft, claims_for_modeling, verify_python, verify_tree
from tests.codegen.helpers import ROOT

KIMI = "kimi_k3"


def planned(project, model, draft=False):
    decls, registry, plans = project
    plan = next(p.plan for p in plans[model][1] if (p.plan.draft is not None) == draft)
    return decls[model], plan, registry


def rendered(project, model=KIMI):
    decl, plan, registry = planned(project, model)
    path = f"{plan.model}/{plan.target}/modeling.py"
    return path, render_modeling(decl, plan, registry, "cmd"), claims_for_modeling(plan, registry)


def refusal(path, text, claims):
    with pytest.raises(GenerationError) as err:
        verify_python(path, text, claims)
    return str(err.value)


def line_of(text, fragment):
    return text[: text.index(fragment)].count("\n") + 1


def test_the_checked_in_tree_satisfies_every_claim(project):
    # RULES GN1, GN4: every Python file of generated/, each under its kind's claims
    decls, registry, plans = project
    root = ROOT / "generated"
    checked = verify_tree(root, [p.plan for _, ts in plans.values() for p in ts], registry)
    assert checked == sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    targets = sum(len(ts) for _, ts in plans.values())
    drafts = sum(1 for _, ts in plans.values() for p in ts if p.plan.draft is not None)
    generic_drafts = len(list(root.glob("*/generic/draft.py")))
    # deepseek_v3, deepseek_r1_nvfp4, glm_5_2, qwen3_next, qwen3_8_flash, nemotron_h and their four tiny MTP models (MTP);
    # deepseek_v4_flash and tiny_deepseek_v4_flash (draft stages)
    assert generic_drafts == 12
    assert len([c for c in checked if c.endswith(("/modeling.py", "/draft.py"))]) == targets + drafts + len(plans) + generic_drafts


def test_a_specialized_build_importing_the_resolver_is_refused(project):
    # RULES GN1: a specialized build never imports the resolver
    path, text, claims = rendered(project)
    bad = text.replace("import torch\n", "import torch\nfrom registry.resolve import moe_impl_request\n", 1)
    line = line_of(bad, "from registry.resolve")
    assert refusal(path, bad, claims) == (
        f"{path}:{line}: claim 'never imports the resolver' does not hold: it imports registry.resolve (RULES GN1)"
    )


def test_a_lazy_import_of_the_resolver_inside_a_function_is_refused_too(project):
    # RULES GN1: an import is an import wherever it sits
    path, text, claims = rendered(project)
    bad = text + "\n\ndef later():\n    import registry.generic\n"
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'import registry.generic')}: claim 'never imports the resolver' does not hold: "
        "it imports registry.generic (RULES GN1)"
    )


def test_importing_an_experts_class_that_is_not_bound_is_refused(project):
    # RULES GN1: the classes imported from runtime.experts.* are exactly the bound ones
    decl, plan, registry = planned(project, KIMI)
    path, text, claims = rendered(project)
    (impl_id,) = plan.bound_ids
    impl = registry.impl(impl_id)
    other = next(i for i in registry.impls if i.module != impl.module)
    bad = text.replace("import torch\n", f"import torch\nfrom {other.module} import {other.class_name}\n", 1)
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'from ' + other.module)}: claim 'imports exactly its bound experts classes' does not hold: "
        f"it imports {other.module}, which holds none of its bound classes ({impl.module}: {impl.class_name}) (RULES GN1)"
    )
    sibling = next(i for i in registry.impls if i.module == impl.module and i.class_name != impl.class_name)
    extra = text.replace(f"import {impl.class_name}\n", f"import {impl.class_name}, {sibling.class_name}\n", 1)
    names = ", ".join(sorted([impl.class_name, sibling.class_name]))
    assert refusal(path, extra, claims) == (
        f"{path}:{line_of(extra, 'from ' + impl.module)}: claim 'imports exactly its bound experts classes' does not hold: "
        f"it imports {impl.module}: {names}; its plan binds {impl.module}: {impl.class_name} (RULES GN1)"
    )


def test_an_import_outside_torch_and_the_runtime_is_refused(project):
    # RULES GN1: only torch, runtime ops and the bound classes
    path, text, claims = rendered(project)
    bad = "import os\n" + text
    assert refusal(path, bad, claims) == (
        f"{path}:1: claim 'imports only torch, runtime ops and its bound experts classes' does not hold: it imports os (RULES GN1)"
    )


def test_loading_a_class_by_name_in_a_specialized_build_is_refused(project):
    # RULES GN1: pre-bound means no run-time lookup of an implementation
    path, text, claims = rendered(project)
    bad = text + "\nEXTRA = build.load_class('runtime.experts.vanilla:TorchEagerBf16Experts')\n"
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'EXTRA =')}: claim 'a specialized build is pre-bound' does not hold: "
        "it calls load_class(), which loads code by name at run time (RULES GN1)"
    )


@pytest.mark.parametrize("name", ["MOE_IMPLS_HONORED", "DRAFT_MOE_IMPLS_HONORED"])
def test_honored_constants_that_differ_from_the_plan_are_refused(project, name):
    # RULES GN1, TG2: the declared constants equal the plan's honored ids
    path, text, claims = rendered(project)
    start = text.index(f"\n{name} = ") + 1
    end = text.index("\n", start)
    bad = text[:start] + f"{name} = ('torch.eager.loop.bf16',)" + text[end:]
    expected = claims.honored if name == "MOE_IMPLS_HONORED" else claims.draft_honored
    what = "the target's honored ids" if name == "MOE_IMPLS_HONORED" else "the target's honored draft ids"
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, name + ' = ')}: claim '{name} equals the plan' does not hold: "
        f"{name} = ('torch.eager.loop.bf16',); {what}: {expected!r} (RULES GN1)"
    )


def test_a_layer_table_entry_that_differs_from_the_plan_is_refused(project):
    # RULES GN1: LAYERS holds the plan's bound id per run of layers
    decl, plan, registry = planned(project, KIMI)
    path, text, claims = rendered(project)
    first = plan.layers[0].impl
    start = text.index("LAYERS = (\n")
    bad = text[:start] + text[start:].replace(f"    (range(0, 1), {first!r}),\n", "    (range(0, 1), 'torch.eager.loop.bf16'),\n", 1)
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'LAYERS = (')}: claim 'LAYERS equals the plan' does not hold: "
        f"LAYERS[0] = (range(0, 1), 'torch.eager.loop.bf16'), but in the plan's layer table it is (range(0, 1), {first!r}) (RULES GN1)"
    )


def test_a_layer_table_whose_runs_cover_other_layers_than_the_plan_is_refused(project):
    # RULES GN1: the runs' ranges are the plan's too, not only the ids
    decl, plan, registry = planned(project, KIMI)
    path, text, claims = rendered(project)
    start = text.index("LAYERS = (\n")
    bad = text[:start] + text[start:].replace("(range(0, 1), ", "(range(0, 2), ", 1)
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'LAYERS = (')}: claim 'LAYERS equals the plan' does not hold: "
        f"LAYERS[0] = (range(0, 2), {plan.layers[0].impl!r}), but in the plan's layer table it is "
        f"(range(0, 1), {plan.layers[0].impl!r}) (RULES GN1)"
    )


def test_a_constant_assigned_twice_is_refused(project):
    # RULES GN1: a second assignment would silently replace the checked one
    path, text, claims = rendered(project)
    bad = text + "\nLAYERS = ()\n"
    assert refusal(path, bad, claims) == (
        f"{path}:{len(bad.splitlines())}: claim 'LAYERS equals the plan' does not hold: "
        "LAYERS is assigned 2 times; a constant is assigned once (RULES GN1)"
    )


def test_implementations_bound_to_another_backend_are_refused(project):
    # RULES GN1: IMPLEMENTATIONS keys are the bound ids, each with its class and backend
    decl, plan, registry = planned(project, KIMI)
    path, text, claims = rendered(project)
    (impl_id,) = plan.bound_ids
    impl = registry.impl(impl_id)
    bad = text.replace(f"({impl.class_name}, '{impl.backend}')", f"({impl.class_name}, 'ELSEWHERE')", 1)
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'IMPLEMENTATIONS = {')}: claim 'IMPLEMENTATIONS equals the plan' does not hold: "
        f"it binds {impl_id} -> {impl.class_name} (ELSEWHERE); the plan binds {impl_id} -> {impl.class_name} ({impl.backend}) (RULES GN1)"
    )


def test_invalid_python_is_refused_naming_the_line(project):
    # RULES GN4: rendered Python is parsed before it is written
    path, text, claims = rendered(project)
    bad = text + "\ndef broken(:\n"
    message = refusal(path, bad, None)
    assert message.startswith(f"{path}:{line_of(bad, 'def broken')}: the template rendered invalid Python: ")


def test_a_draft_binds_exactly_its_own_implementations(project):
    # RULES GN1, DR1: draft.py imports the draft's bound classes and declares DRAFT_LAYERS from the plan
    decl, plan, registry = planned(project, "tiny_deepseek_v3", draft=True)
    path = f"{plan.model}/{plan.target}/draft.py"
    claims = claims_for_draft(plan, registry)
    text = render_draft(decl, plan, registry, "cmd")
    verify_python(path, text, claims)
    (index, impl_id) = claims.draft_layers[0]
    bad = text.replace(f"({index}, {impl_id!r})", f"({index + 1}, {impl_id!r})", 1)
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'DRAFT_LAYERS = (')}: claim 'DRAFT_LAYERS equals the plan' does not hold: "
        f"DRAFT_LAYERS = (({index + 1}, {impl_id!r}),); the plan's draft layer table: (({index}, {impl_id!r}),) (RULES GN1)"
    )


def test_a_generic_build_resolves_through_registry_generic_and_names_no_experts_class(project):
    # RULES GN1: the generic build resolves at load and imports the resolver, not an experts class
    decls, registry, plans = project
    decl, generic = decls[KIMI], plans[KIMI][0]
    path = f"{KIMI}/generic/modeling.py"
    text = render_generic(decl, generic, registry, "cmd")
    verify_python(path, text, GENERIC_CLAIMS)
    assert refusal(path, text.replace("from registry.generic import resolve_build\n", ""), GENERIC_CLAIMS) == (
        f"{path}:1: claim 'a generic build resolves through registry.generic' does not hold: "
        "it does not import registry.generic (RULES GN1)"
    )
    bad = text.replace("import torch\n", "import torch\nfrom runtime.experts.vanilla import TorchEagerBf16Experts\n", 1)
    assert refusal(path, bad, GENERIC_CLAIMS) == (
        f"{path}:{line_of(bad, 'from runtime.experts.vanilla')}: claim 'a generic build imports no experts class directly' "
        "does not hold: it imports runtime.experts.vanilla (RULES GN1)"
    )


def test_a_build_binding_an_id_its_target_does_not_honor_is_refused(tmp_path):
    # RULES GN1, TG4: a declared list of honored ids is a hard constraint on what a build binds
    from registry.declarations import find_model, load_models
    from registry.impls import load_registry
    from registry.selection import Selection
    from codegen.plan import target_plan
    from tests.codegen.helpers import EAGER_BF16, GROUPED_BF16, MYMOE, write_models

    decl = find_model("mymoe", load_models(write_models(tmp_path, mymoe=MYMOE)))
    target = next(t for t in decl.targets if t.parallel == "tp1")
    plan, resolution = target_plan(decl, target, Selection(tactic="eager"))   # refused, but planned anyway
    assert not resolution.claimed
    registry = load_registry()
    path = f"mymoe/{target.name}/modeling.py"
    text = render_modeling(decl, plan, registry, "cmd")
    assert refusal(path, text, claims_for_modeling(plan, registry)) == (
        f"{path}:{line_of(text, 'IMPLEMENTATIONS = {')}: claim 'binds only honored ids' does not hold: it binds "
        f"{EAGER_BF16}, which MOE_IMPLS_HONORED ({GROUPED_BF16!r},) does not list (TG4) (RULES GN1)"
    )


# --- the allow-list (RULES GN4): an injected call fails even where no template claim looks -------------

ALLOW = "names only what it binds, imports or an allowed builtin"
API = "uses only the runtime API its kind may"


@pytest.mark.parametrize("code, claim, detail", [
    ("__import__('os').system('touch pwned')", ALLOW, "it calls __import__()"),
    ("eval('1 + 1')", ALLOW, "it calls eval()"),
    ("open('/tmp/pwned', 'w')", ALLOW, "it calls open()"),
    ("getattr(getattr(torch, 'lo' + 'ad'), '__call__')('x.pt')", ALLOW, "it calls getattr()"),
    ("__builtins__['exec']('x = 1')", ALLOW, "it names __builtins__"),
    ("torch.load('x.pt')", API, "it reads the attribute .load"),
    ("torch.hub.load('a', 'b')", API, "it reads the attribute .hub"),
    ("().__class__.__bases__[0].__subclasses__()", API, "it reads the attribute .__class__"),
    ("f'{nn.Module.__init__.__globals__}'", API, "it reads the attribute .__globals__"),
])
def test_an_injected_call_in_a_generic_build_fails_the_allow_list_at_its_line(project, code, claim, detail):
    decls, registry, plans = project
    path = f"{KIMI}/generic/modeling.py"
    text = render_generic(decls[KIMI], plans[KIMI][0], registry, "cmd")
    bad = text + f"\n\nPAYLOAD = {code}\n"
    assert refusal(path, bad, GENERIC_CLAIMS) == (
        f"{path}:{line_of(bad, 'PAYLOAD = ')}: claim '{claim}' does not hold: {detail} (RULES GN4)"
    )


def test_exec_smuggled_out_of_a_docstring_fails_the_allow_list(project):
    # A value that ended the module docstring would run as module code: that code names exec.
    path, text, claims = rendered(project)
    first = text.index('"""') + 3
    bad = text[:first] + 'x"""\nexec("import os")\n"""' + text[first:]
    assert refusal(path, bad, claims) == (
        f"{path}:{line_of(bad, 'exec(')}: claim '{ALLOW}' does not hold: it calls exec() (RULES GN4)"
    )


def test_a_constants_only_module_may_import_call_and_read_nothing(project):
    decls, registry, plans = project
    from codegen.outputs import model_outputs

    facts = next(o for o in model_outputs(decls[KIMI], plans[KIMI][0], registry) if o.path.endswith("facts.py"))
    verify_python(facts.path, facts.content, facts.claims)
    assert facts.claims == DATA_CLAIMS
    bad = facts.content + "\nimport os\n"
    assert refusal(facts.path, bad, DATA_CLAIMS) == (
        f"{facts.path}:{line_of(bad, 'import os')}: claim 'imports only what its kind may' does not hold: it imports os (RULES GN4)"
    )
    bad = facts.content + "\nX = print('pwned')\n"
    assert refusal(facts.path, bad, DATA_CLAIMS) == (
        f"{facts.path}:{line_of(bad, 'X = ')}: claim '{ALLOW}' does not hold: it calls print() (RULES GN4)"
    )
    bad = facts.content + "\nX = CONFIG.copy()\n"
    assert refusal(facts.path, bad, DATA_CLAIMS) == (
        f"{facts.path}:{line_of(bad, 'X = ')}: claim '{API}' does not hold: it reads the attribute .copy (RULES GN4)"
    )


def test_names_a_module_binds_itself_pass_and_a_shadowed_builtin_is_still_refused_where_it_is_not_bound(project):
    path, text, claims = rendered(project)
    verify_python(path, text + "\n\ndef helper(a, *rest, key=None):\n    (b, c) = a\n    return [d for d in rest if d is key], b, c\n", claims)
    assert refusal(path, text + "\n\ndef helper():\n    return compile('1', 'f', 'eval')\n", claims).endswith(
        f"claim '{ALLOW}' does not hold: it calls compile() (RULES GN4)"
    )

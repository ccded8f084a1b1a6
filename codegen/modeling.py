"""Render model files: a target's specialized `modeling.py` and `draft.py`, and a model's generic build.

Builds the template context from a plan: the family's normalized constants, the bound experts
classes and their imports, the layer table, and the one-paragraph summary at the top of the file.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

from codegen.errors import GenerationError
from codegen.modelspec import normalize
from codegen.plan import BuildPlan, LayerPlan, camel, fingerprint
from codegen.render import py_block, render_python
from contract import ROLE_NAMES
from families import FAMILIES, template_name
from families.base import FamilySpec
from registry.declarations import Declaration
from registry.impls import Registry
from registry.layer_task import span
from registry.normal_config import rope

_OPS = ("MoEBlock", "RMSNorm", "RotaryEmbedding")  # embedding and head: runtime.causal_lm builds them
# Published Eagle3 heads are Llama layers: Llama's rotary defaults (base 10000, the full head).
_LLAMA_ROPE_DEFAULTS = {"rope_theta": 10000.0}


def _experts_spec(decl: Declaration, c: dict) -> str:
    """MoeShape arguments in terms of the inlined constants. The registry resolved each layer against
    `family.shape(config)`; the template's constants come from `normalize`: both must say the same."""
    spec = decl.family
    shape = spec.shape(decl.config)
    inlined = (c["hidden_size"], c[spec.intermediate_key], c[spec.experts_key], c["num_experts_per_tok"])
    resolved = (shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k)
    if inlined != resolved:
        raise GenerationError(f"{decl.model.name}: the experts shape {resolved} the registry resolved differs from the constants {inlined}")
    args = f"activation={shape.activation!r}, expert_bias={shape.expert_bias}"
    if shape.activation == "swiglu_oai":
        args += f", swiglu_alpha={float(c['swiglu_alpha'])!r}, swiglu_limit={float(c['swiglu_limit'])!r}"
    return f"\n    hidden_size=HIDDEN_SIZE, intermediate_size=MOE_INTERMEDIATE_SIZE, num_experts=NUM_EXPERTS, top_k=TOP_K,\n    {args},\n"


def _constant(value) -> str:
    """A constant of modeling.py: on one line when it fits in 100 characters, else a dict one entry per line
    or a table of like values packed."""
    return py_block(value, width=100, fill=True)


def _architecture(spec: FamilySpec, c: dict, plan: BuildPlan) -> list[str]:
    """What the file builds, in two or three lines: its layers and experts, its attention and rotary."""
    moe = tuple(l.index for l in plan.layers if l.kind == "moe")
    dense = tuple(l.index for l in plan.layers if l.kind != "moe")
    layers = f"{len(plan.layers)} decoder layers, " + ("all MoE" if not dense else f"MoE {span(moe)}, dense {span(dense)}")
    shared = f" + {c['n_shared_experts']} shared" if spec.shared_experts else ""
    r = c["rope"]
    base = int(r["base"]) if r["base"] is not None and float(r["base"]).is_integer() else r["base"]
    scaled = f" {r['scaling']} x{r['factor']:g}" if r["scaling"] not in ("default", "none") else ""
    attention, rotary = spec.describe_attention(c, f"rotary{scaled}", base)
    first = f"{layers}; {c[spec.experts_key]} routed experts, top-{c['num_experts_per_tok']}{shared}."
    if len(first) > 120:   # interleaved layouts (Nemotron-H's pattern): counts only, the indices would not fit
        layers = f"{len(plan.layers)} decoder layers, {len(moe)} MoE and {len(dense)} dense, interleaved"
        first = f"{layers}; {c[spec.experts_key]} routed experts, top-{c['num_experts_per_tok']}{shared}."
    if len(attention) + len(rotary) < 100:
        return [first, f"{attention}; {rotary}."]
    return [first, f"{attention};", f"{rotary}."]


def _summary(plan: BuildPlan) -> list[str]:
    lines = []
    for report in plan.resolution.get("layers", []):
        kind = ROLE_NAMES[report["role"]]
        where = span(tuple(report["layers"]))
        if len(where) > 40:   # an interleaved layout's indices would not fit a line: LAYERS lists them
            where = f"({len(report['layers'])}, LAYERS lists them)"
        lines.append(
            f"MoE {kind} layers {where} ({report['run_format']}): {report['winner']} "
            f"({report['backend']}, {report['selected_by']})."
        )
        lines.append(f"  Weights {report['weights']}; {report['verification']}.")
    return lines


def _context(decl: Declaration, plan: BuildPlan, registry: Registry, generic: bool) -> dict:
    spec = decl.family
    family = spec.name
    c = normalize(family, decl.config, f"model {decl.model.name}")
    has_dense = any(l.kind != "moe" for l in plan.layers)
    ops = set(_OPS) | set(spec.attention_ops)
    # The template's make_mtp (and its op) only where this build's draft file calls it.
    draft = generic_draft(decl) if generic else plan.draft
    mtp_builder = bool(spec.mtp_tree) and draft is not None and draft.kind in ("embedded_mtp", "replacement_mtp")
    if mtp_builder:
        ops.add(spec.mtp_predictor)
    if has_dense or spec.shared_experts:
        ops.add("MLP")
    impls = sorted({l.impl for l in plan.layers if l.impl})
    imports: dict[str, list[str]] = {}
    for impl_id in impls:
        impl = registry.impl(impl_id)
        imports.setdefault(impl.module, []).append(impl.class_name)
    experts_per_rank = spec.shape(decl.config).num_experts // plan.layout[2] if plan.layout else None
    return dict(
        plan=plan,
        experts_per_rank=experts_per_rank,
        family=family,
        generic=generic,
        c=c,
        has_dense=has_dense,
        mtp_builder=mtp_builder,
        experts_key=spec.experts_key,
        intermediate_key=spec.intermediate_key,
        mlp_attr=spec.mlp_attr,
        backbone_names=spec.backbone_names,
        ops_imports=sorted(ops, key=lambda name: (name[0].islower(), name)),
        router_class=spec.router,
        experts_imports=sorted((m, sorted(set(n))) for m, n in imports.items()),
        implementations=[(i, registry.impl(i).class_name, registry.impl(i).backend) for i in impls],
        cpu_impls=tuple(i for i in impls if registry.impl(i).cpu),
        honored=_constant(plan.moe_impls_honored),
        draft_honored=_constant(plan.draft_moe_impls_honored),
        # The draft's tensors live in the checkpoint beside the target's: the target build skips exactly those.
        ignored=spec.draft_ignore(decl.config) + stages_ignore(decl),
        experts_spec=_experts_spec(decl, c),
        rope_literal=_constant(c["rope"]),
        windows_literal=_constant(c["sliding_windows"]),
        architecture=_architecture(spec, c, plan),
    )


def render_modeling(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    path = f"{plan.model}/{plan.target}/modeling.py"
    context = _context(decl, plan, registry, generic=False)
    title = f"{plan.target}: {plan.model} ({plan.family}), its MoE kernels pre-bound for sm_{plan.sm}."
    return render_python(template_name(plan.family), path, command, plan.fingerprint, f"Specialized build {plan.target}.",
                         title=title, summary=context["architecture"] + [""] + _summary(plan), **context)


def render_generic(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    path = f"{plan.model}/generic/modeling.py"
    context = _context(decl, plan, registry, generic=True)
    title = f"{plan.model} ({plan.family}), generic build: each MoE layer resolves when the model loads."
    summary = context["architecture"] + [
        "",
        "Serves any checkpoint, SM, parallel layout and selection of this model that no specialized build",
        "claims (RULES TG5); it runs the same request and resolution code the generator does (RULES GN1).",
    ]
    return render_python(template_name(plan.family), path, command, plan.fingerprint, f"Generic build of {plan.model}.",
                         title=title, summary=summary, **context)


def render_draft(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    """The target's draft build, bound to the draft's own implementations (RULES DR1, DR2)."""
    draft = plan.draft
    if draft.kind == "external":
        return _render_external(decl, plan, registry, command)
    if draft.kind == "eagle3":
        return _render_eagle3(decl, plan, command)
    spec = decl.family
    if draft.kind == "embedded_mtp" and spec.mtp_refusal:
        raise GenerationError(f"{plan.target}: {spec.mtp_refusal}, so {draft.name} has nothing to load; declare an eagle3 or "
                              "external draft for this model")
    stages_of = _stages_families()
    if (draft.kind not in ("embedded_mtp", "replacement_mtp", "draft_stages") or not spec.mtp_draft
            or (draft.kind == "draft_stages" and spec.name not in stages_of)):
        raise GenerationError(
            f"{plan.target}: the runtime builds embedded and replacement-head MTP drafts of {mtp_families()}, draft stages of "
            f"{stages_families()}, external drafters and Eagle3 heads; {draft.name} is a {draft.kind} draft of family "
            f"{spec.name}: declare the target's selection without this spec_mode"
        )
    impls = sorted({l.impl for l in draft.layers})
    imports: dict[str, list[str]] = {}
    for impl_id in impls:
        impl = registry.impl(impl_id)
        imports.setdefault(impl.module, []).append(impl.class_name)
    summary = [line for line in _summary(plan) if " draft " in line]
    return render_python(
        "draft_mtp.py.j2", f"{plan.model}/{plan.target}/draft.py", command, plan.fingerprint, f"Draft of {plan.target}.",
        plan=plan, draft=draft, summary=summary, generic=False, **_mtp_kind(spec),
        stages=_stages_tree(decl, next(d for d in decl.drafts if d.name == draft.name), plan.target) if draft.kind == "draft_stages" else None,
        experts_imports=sorted((m, sorted(set(n))) for m, n in imports.items()),
        implementations=[(i, registry.impl(i).class_name, registry.impl(i).backend) for i in impls],
        cpu_impls=tuple(i for i in impls if registry.impl(i).cpu),
    )


def _drafter(decl: Declaration, plan: BuildPlan) -> tuple[Declaration, BuildPlan]:
    """An external drafter as a model of its own family (its config, its checkpoint) and the plan of its build:
    the target's SM and layout, the draft layers' bindings, the target's honored draft ids as its honored set."""
    declared = next(d for d in decl.drafts if d.name == plan.draft.name)
    if not FAMILIES[declared.family].runtime:
        raise GenerationError(
            f"{plan.target}: the external drafter {declared.name} is of family {declared.family}, which the runtime "
            "does not build; declare a drafter of a runtime family or a selection without this spec_mode"
        )
    own = Declaration.model_validate({
        "model": {"name": plan.model, "family": declared.family, "doc": declared.doc or declared.name},
        "config": declared.config, "checkpoints": [declared.checkpoint.model_dump()],
    })
    moe = {l.index: l for l in plan.draft.layers}
    layers = tuple(moe.get(i, LayerPlan(i, "dense")) for i in range(declared.config["num_hidden_layers"]))
    return own, replace(
        plan, family=declared.family, class_name=camel(declared.name) + "ForCausalLM", checkpoint=declared.checkpoint.name,
        config=declared.config, layers=layers, moe_impls_honored=plan.draft_moe_impls_honored, draft_moe_impls_honored=None,
    )


def _render_external(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    """An external drafter: its own family's build (its config, the draft selection's bindings) plus the draft interface."""
    own, drafter = _drafter(decl, plan)
    context = _context(own, drafter, registry, generic=False)
    title = f"{plan.target} draft: {plan.draft.name}, an external {drafter.family} drafter."
    summary = ([f"Speculative mode {plan.draft.mode}; its MoE kernels pre-bound for sm_{plan.sm}.", ""] + context["architecture"]
               + [""] + [line for line in _summary(plan) if " draft " in line])
    return render_python("draft_external.py.j2", f"{plan.model}/{plan.target}/draft.py", command, plan.fingerprint,
                         f"Draft of {plan.target}.", title=title, summary=summary, draft=plan.draft, **context)


def mtp_families() -> str:
    """The families whose embedded and replacement-head MTP drafts the runtime builds, for messages."""
    names = [name for name, spec in FAMILIES.items() if spec.mtp_draft]
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def eagle3_aux_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs an Eagle3 head fuses. vLLM and SGLang capture the residual stream
    entering layers `eagle_aux_hidden_state_layer_ids` (default 2, L // 2, L - 3), i.e. after the layer before
    each (the declaration checked them when it loaded)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids", [2, target_layers // 2, target_layers - 3])
    return tuple(i - 1 for i in ids)


def _render_eagle3(decl: Declaration, plan: BuildPlan, command: str) -> str:
    """An Eagle3 head (runtime.ops.eagle3) with the shape its declared config gives (checked when it loaded)."""
    c = dict(next(d for d in decl.drafts if d.name == plan.draft.name).config)
    head = {k: c[k] for k in ("vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "intermediate_size")}
    head |= {"num_heads": c["num_attention_heads"], "num_kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
             "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6))}
    return render_python(
        "draft_eagle3.py.j2", f"{plan.model}/{plan.target}/draft.py", command, plan.fingerprint, f"Draft of {plan.target}.",
        plan=plan, draft=plan.draft, c=c, head=head, rope=rope(c, _LLAMA_ROPE_DEFAULTS, c["head_dim"]),
        aux_layers=eagle3_aux_layers(c, decl.config["num_hidden_layers"]),
    )


def _stages_families() -> tuple[str, ...]:
    """The families whose embedded draft stages the runtime builds: MTP drafts as `model.layers.<i>` blocks (MTPDraft)."""
    return tuple(name for name, s in FAMILIES.items() if s.mtp_draft and not s.mtp_tree)


def stages_families() -> str:
    """The families whose embedded draft stages the runtime builds, for messages."""
    return " and ".join(_stages_families())


def generic_draft(decl: Declaration):
    """The draft a model's generic build constructs (resolved at load), or None: the generic build of a family
    whose MTP draft the runtime builds (`spec.mtp_draft`) builds its embedded or replacement-head MTP, or its
    embedded draft stages where the runtime builds the family's stages (RULES DR7); other kinds only as a target's."""
    if not decl.family.mtp_draft:
        return None
    for draft in decl.drafts:
        count = draft.num_layers if draft.num_layers is not None else decl.family.num_draft_layers(decl.config)
        if draft.kind in ("embedded_mtp", "replacement_mtp") and count:
            return draft
        if draft.kind == "draft_stages" and count and decl.family.name in _stages_families():
            return draft
    return None


def render_generic_draft(decl: Declaration, plan: BuildPlan, command: str) -> str:
    """The generic build's draft (resolved at load), through the template and runtime class a target's draft of
    that kind uses. Its text reads the model's name, the declared draft's name, kind and first mode and, for draft
    stages, their module under `model.`, and nothing else of the generic plan: its fingerprint is theirs (GN2)."""
    declared = generic_draft(decl)
    stages = _stages_tree(decl, declared, f"{plan.model}/generic") if declared.kind == "draft_stages" else None
    draft = SimpleNamespace(name=declared.name, kind=declared.kind, mode=declared.modes[0], layers=())
    inputs = {"model": plan.model, "draft": {"name": draft.name, "kind": draft.kind, "mode": draft.mode}}
    if stages is not None:
        inputs["draft"]["stages"] = stages
    summary = ["Serves what the generic modeling.py serves; its MoE layers resolve when it loads, under the draft's",
               f"own selection (RULES DR1, {'DR7' if stages else 'DR2'}, GN1)."]
    return render_python("draft_mtp.py.j2", f"{plan.model}/generic/draft.py", command, fingerprint(inputs),
                         f"Generic draft of {plan.model}.", plan=SimpleNamespace(model=plan.model), draft=draft,
                         summary=summary, generic=True, stages=stages, **_mtp_kind(decl.family))


def _stages_tree(decl: Declaration, declared, site: str) -> str:
    """The module under `model.` that holds the draft stages `declared` (RULES DR7), read from their declared experts
    prefix; `site` (a target, or `<model>/generic`) names the build in the refusal.

    What a draft stage is at run time (assumed; DeepSeek-V4-Flash's stages are not public): an MTP-like layer each,
    laid out and chained as DeepSeek-V3's MTP layers are (`enorm`, `hnorm`, `eh_proj`, the family's decoder layer,
    `shared_head`, its own `embed_tokens`), named `model.<tree>.<k>` instead of `model.layers.<61 + k>`; its
    experts in their own format (the declaration's quant metadata for that prefix)."""

    found = re.fullmatch(r"model\.([a-z][a-z0-9_]*)\.\{k\}\." + re.escape(decl.family.mlp_attr) + r"\.experts", declared.experts_prefix)
    if found is None or found.group(1) == "layers":
        raise GenerationError(
            f"{site}: draft stages {declared.name} have experts_prefix {declared.experts_prefix!r}; the runtime builds stages "
            f"named 'model.<name>.{{k}}.{decl.family.mlp_attr}.experts' (one MTP-like layer each, <name> not 'layers')"[:400])
    return found.group(1)


def stages_ignore(decl: Declaration) -> tuple[str, ...]:
    """fnmatch patterns of the declared draft stages' tensors, which a target build skips (one per stage)."""
    out = []
    for draft in decl.drafts:
        if draft.kind == "draft_stages":
            module = draft.experts_prefix.split("{k}")[0]
            out += [f"{module}{k}.*" for k in range(draft.num_layers)]
    return tuple(out)


def _mtp_kind(spec) -> dict:
    """What draft_mtp.py.j2 reads of the family: its MTP layers as `model.layers.<i>` blocks (MTPDraft) or as a
    tree of their own (PredictorMTPDraft, its checkpoint names of the backbone and final norm)."""
    if spec.mtp_tree:
        return {"draft_class": "PredictorMTPDraft", "mtp_tree": spec.mtp_tree, "backbone_names": spec.backbone_names}
    return {"draft_class": "MTPDraft", "mtp_tree": None, "backbone_names": None}

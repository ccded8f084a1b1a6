"""Render model files: a target's specialized `modeling.py` and `draft.py`, and a model's generic build.

Builds the template context from a plan: the family's normalized constants, the bound experts
classes and their imports, the layer table, and the one-paragraph summary at the top of the file.
"""

from __future__ import annotations

from codegen.modelspec import normalize
from codegen.plan import BuildPlan
from codegen.render import render_python
from registry.declarations import Declaration
from registry.impls import Registry
from registry.model_resolve import span

_OPS = {
    "deepseek_v3": ("LMHead", "MLAttention", "MLP", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding", "mla_softmax_scale"),
    "glm4_moe": ("GQAttention", "LMHead", "MLP", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"),
    "qwen3_moe": ("GQAttention", "LMHead", "MLP", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"),
    "mixtral": ("GQAttention", "LMHead", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"),
    "minimax_m2": ("GQAttention", "LMHead", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"),
    "gpt_oss": ("GQAttention", "LMHead", "MoEBlock", "RMSNorm", "RotaryEmbedding", "VocabEmbedding"),
}
_ROUTER = {
    "deepseek_v3": "SigmoidTopKRouter", "glm4_moe": "SigmoidTopKRouter", "minimax_m2": "SigmoidTopKRouter",
    "qwen3_moe": "SoftmaxTopKRouter", "mixtral": "SoftmaxTopKRouter", "gpt_oss": "LinearTopKSoftmaxRouter",
}
_MLP_ATTR = {"mixtral": "block_sparse_moe", "minimax_m2": "block_sparse_moe"}
_KEYS = {  # family -> (experts count key, expert intermediate key)
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
    "glm4_moe": ("n_routed_experts", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
    "minimax_m2": ("num_local_experts", "intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
}


def _experts_spec(decl: Declaration) -> str:
    shape = decl.family.shape(decl.config)
    args = (
        f"hidden_size={shape.hidden_size}, intermediate_size={shape.intermediate_size}, num_experts={shape.num_experts}, "
        f"top_k={shape.top_k}, activation={shape.activation!r}, expert_bias={shape.expert_bias}"
    )
    if shape.activation == "swiglu_oai":
        args += f", swiglu_limit={float(decl.config.get('swiglu_limit', 7.0))!r}"
    return args


def _ignored(decl: Declaration) -> tuple[str, ...]:
    """The draft's tensors live in the checkpoint beside the target's; the target build skips them."""
    family = decl.family
    count = family.num_draft_layers(decl.config) if family.draft_experts_prefix else 0
    if not count:
        return ()
    base = decl.config["num_hidden_layers"]
    if family.draft_experts_prefix.startswith("model.layers."):
        return tuple(f"model.layers.{base + k}.*" for k in range(count))
    return (family.draft_experts_prefix.split(".")[0] + ".*",)


def _summary(plan: BuildPlan) -> list[str]:
    lines = []
    for report in plan.resolution.get("layers", []):
        kind = {"target": "routed", "excluded": "excluded", "draft": "draft"}[report["role"]]
        lines.append(
            f"MoE {kind} layers {span(tuple(report['layers']))} ({report['run_format']}): {report['winner']} "
            f"({report['family']}, {report['selected_by']})."
        )
    return lines


def _context(decl: Declaration, plan: BuildPlan, registry: Registry, generic: bool) -> dict:
    family = decl.family.name
    experts_key, intermediate_key = _KEYS[family]
    impls = sorted({l.impl for l in plan.layers if l.impl})
    imports: dict[str, list[str]] = {}
    for impl_id in impls:
        impl = registry.impl(impl_id)
        imports.setdefault(impl.module, []).append(impl.class_name)
    return dict(
        plan=plan,
        family=family,
        generic=generic,
        c=normalize(family, decl.config),
        experts_key=experts_key,
        intermediate_key=intermediate_key,
        mlp_attr=_MLP_ATTR.get(family, "mlp"),
        ops_imports=_OPS[family],
        router_class=_ROUTER[family],
        experts_imports=sorted((m, sorted(set(n))) for m, n in imports.items()),
        implementations=[(i, registry.impl(i).class_name, registry.impl(i).family) for i in impls],
        cpu_impls=tuple(i for i in impls if registry.impl(i).cpu),
        honored=plan.moe_impls_honored if not isinstance(plan.moe_impls_honored, list) else tuple(plan.moe_impls_honored),
        draft_honored=plan.draft_moe_impls_honored if not isinstance(plan.draft_moe_impls_honored, list) else tuple(plan.draft_moe_impls_honored),
        ignored=_ignored(decl),
        experts_spec=_experts_spec(decl),
    )


def render_modeling(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    path = f"{plan.model}/{plan.target}/modeling.py"
    context = _context(decl, plan, registry, generic=False)
    title = f"{plan.target}: {plan.model} ({plan.family}) with its MoE kernels pre-bound for sm_{plan.sm}, parallel {plan.parallel}."
    return render_python(f"family/{plan.family}.py.j2", path, command, plan.fingerprint, f"Specialized build {plan.target}.",
                         title=title, summary=_summary(plan), **context)


def render_generic(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    path = f"{plan.model}/generic/modeling.py"
    context = _context(decl, plan, registry, generic=True)
    title = f"{plan.model} ({plan.family}), generic build: each MoE layer resolves when the model loads."
    summary = [
        "Serves any checkpoint, SM, parallel layout and selection of this model that no specialized build",
        "claims (RULES TG5); it runs the same request and resolution code the generator does (RULES GN1).",
    ]
    return render_python(f"family/{plan.family}.py.j2", path, command, plan.fingerprint, f"Generic build of {plan.model}.",
                         title=title, summary=summary, **context)


def render_draft(decl: Declaration, plan: BuildPlan, registry: Registry, command: str) -> str:
    """An embedded MTP draft (DeepSeek-V3 / GLM-4 MoE layout) bound to the draft's own implementation."""
    draft = plan.draft
    if draft.kind != "embedded_mtp" or decl.family.name not in ("deepseek_v3", "glm4_moe"):
        from codegen.files import GenerationError

        raise GenerationError(
            f"{plan.target}: the runtime builds embedded MTP drafts of deepseek_v3 and glm4_moe; {draft.name} is a "
            f"{draft.kind} draft of family {decl.family.name}: declare the target's selection without this spec_mode"
        )
    impls = sorted({l.impl for l in draft.layers})
    imports: dict[str, list[str]] = {}
    for impl_id in impls:
        impl = registry.impl(impl_id)
        imports.setdefault(impl.module, []).append(impl.class_name)
    summary = [line for line in _summary(plan) if " draft " in line]
    return render_python(
        "draft_mtp.py.j2", f"{plan.model}/{plan.target}/draft.py", command, plan.fingerprint, f"Draft of {plan.target}.",
        plan=plan, draft=draft, summary=summary,
        experts_imports=sorted((m, sorted(set(n))) for m, n in imports.items()),
        implementations=[(i, registry.impl(i).class_name, registry.impl(i).family) for i in impls],
        cpu_impls=tuple(i for i in impls if registry.impl(i).cpu),
    )

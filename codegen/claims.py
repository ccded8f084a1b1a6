"""What each kind of generated Python file may say (RULES GN1, GN4): its allow-list, and the claims its plan makes.

The allow-list names, per kind of file, the builtins it may name, the attributes it may read and the
modules it may import; the claims of a build's model file are computed from its plan and the registry,
never from the template. `codegen.verify` checks a rendered file against both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from codegen.plan import layer_runs

SPECIALIZED, DRAFT, GENERIC = "specialized", "draft", "generic"
DATA, ROOT = "data", "root"   # constants only (facts, the build index, package docstrings); the root package's code

# The allow-list (RULES GN4): the builtins each kind of module may name besides what it binds itself
# (so never eval, exec, open, getattr, __import__, globals...), the attributes it may read (the
# runtime, torch and nn API the templates use; no dunder but __init__), the modules it may import.
MODEL_BUILTINS = frozenset({"True", "False", "None", "super", "range", "len", "tuple", "enumerate", "str", "float", "ValueError"})
BUILTINS = {
    SPECIALIZED: MODEL_BUILTINS,
    DRAFT: MODEL_BUILTINS,
    GENERIC: MODEL_BUILTINS,
    DATA: frozenset({"True", "False", "None", "float"}),   # float('nan') and float('inf'): codegen.render.py
    ROOT: frozenset({"True", "False", "None", "__name__", "__package__"}),
}
MODEL_ATTRIBUTES = frozenset({
    # torch and torch.nn
    "arange", "bfloat16", "device", "dtype", "shape", "Module", "ModuleList", "__init__",
    # runtime.build, runtime.parallel.Layout, the generic build's resolution (checks, logging, loading and
    # random init are runtime.causal_lm's and runtime.draft_build's, so no build file calls them)
    "load_class", "cpu_impls", "implementations",
    "resolution", "layers", "layout", "ep", "ep_rank", "moe_tp", "moe_tp_rank", "tp", "tp_rank", "world", "items",
    # the modules a build is made of (checkpoint names)
    "model", "embed_tokens", "self_attn", "linear_attn", "mlp", "block_sparse_moe", "input_layernorm", "post_attention_layernorm",
    "norm", "rotary_emb", "lm_head", "hidden_states", "rank", "mixer",
    # the pre-norm layer's residual add fused with its norm (runtime.ops.norms.RMSNorm.add_forward)
    "add_forward",
    # a hybrid layer states its own decode state (Qwen3-Next's DeltaNet: `new_cache`)
    "new_cache",
    # generic MTP drafts, resolved at load
    "spec_mode", "draft_layers",
})
ATTRIBUTES = {
    SPECIALIZED: MODEL_ATTRIBUTES,
    DRAFT: MODEL_ATTRIBUTES,
    GENERIC: MODEL_ATTRIBUTES,
    DATA: frozenset(),
    # The root's shims: what they take from serving.load.Builds and serving.run.Launcher, and sys.exit.
    ROOT: frozenset({"load_model", "describe", "write_tiny", "main", "preload", "exit"}),
}
# The root package's shims import `sys` and `serving` (which routes through the registry and launches the runtime).
ROOT_IMPORTS = frozenset({"sys", "serving"})

# Calls that would load a class by name at run time, and so undo the pre-binding of a specialized build.
DYNAMIC_LOADERS = ("__import__", "import_module", "load_class")
# The only runtime.experts module a build may import besides its bound classes' modules: the contract.
EXPERTS_CONTRACT = "runtime.experts.base"


@dataclass(frozen=True)
class Claims:
    """What a build file must say, computed from its plan and the registry (never from the template).

    `honored`/`draft_honored` are the literals `MOE_IMPLS_HONORED`/`DRAFT_MOE_IMPLS_HONORED` must hold;
    `implementations` maps each bound id to (experts class name, backend); `experts` maps each bound
    class's module to the class names the file must import from it, and nothing else from
    `runtime.experts`; `layers` is `LAYERS` (modeling.py: runs `(range(start, stop), id)`), `draft_layers`
    is `DRAFT_LAYERS` (draft.py).
    """

    kind: str
    honored: object = None
    draft_honored: object = None
    implementations: dict = field(default_factory=dict)
    experts: dict = field(default_factory=dict)
    layers: tuple | None = None
    draft_layers: tuple | None = None


def claims_for_modeling(plan, registry) -> Claims:
    """A specialized `modeling.py`: its target layers' bound ids, classes, honored sets and layer table."""
    ids = sorted({l.impl for l in plan.layers if l.impl})
    return Claims(
        kind=SPECIALIZED,
        honored=plan.moe_impls_honored,
        draft_honored=plan.draft_moe_impls_honored,
        implementations={i: (registry.impl(i).class_name, registry.impl(i).backend) for i in ids},
        experts=_experts(ids, registry),
        layers=tuple((range(r.start, r.stop), r.impl) for r in layer_runs(plan.layers)),
    )


def claims_for_draft(plan, registry) -> Claims:
    """A specialized `draft.py`: the draft layers' bound ids and classes."""
    ids = sorted({l.impl for l in plan.draft.layers if l.impl})
    return Claims(
        kind=DRAFT,
        draft_honored=plan.draft_moe_impls_honored,
        implementations={i: (registry.impl(i).class_name, registry.impl(i).backend) for i in ids},
        experts=_experts(ids, registry),
        draft_layers=tuple((l.index, l.impl) for l in plan.draft.layers),
    )


GENERIC_CLAIMS = Claims(kind=GENERIC)
DATA_CLAIMS = Claims(kind=DATA)
ROOT_CLAIMS = Claims(kind=ROOT)


def _experts(ids, registry) -> dict:
    modules: dict[str, set[str]] = {}
    for impl_id in ids:
        impl = registry.impl(impl_id)
        modules.setdefault(impl.module, set()).add(impl.class_name)
    return {m: frozenset(n) for m, n in modules.items()}

"""The implementation catalog (`docs/moe_impl_catalog.md`), rendered from the registry (RULES GN5, TA3)."""

from __future__ import annotations

from registry.impls import AUTO, Registry
from registry.tactics import shortest_query

from codegen.headers import MARKER

PATH = "docs/moe_impl_catalog.md"
COMMAND = "python -m codegen catalog"


def _cell(text: str) -> str:
    """A registry doc line as a table cell: a bare pipe would end the cell early."""
    return text.replace("|", "\\|")


def _caps(impl) -> str:
    c = impl.capabilities
    flags = [name for name, on in (
        ("expert bias", c.expert_bias),
        ("router weight on input", c.router_weight_on_input),
        ("dynamic EPLB", c.dynamic_eplb),
        ("EP", c.expert_parallel),
        ("MoE TP", c.moe_tensor_parallel),
    ) if on]
    return ", ".join(flags + sorted(c.activations))


def render_catalog(registry: Registry) -> str:
    lines = [
        f"<!-- {MARKER} Regenerate: {COMMAND} -->",
        "# MoE implementation catalog",
        "",
        "Every registered implementation in global priority order: `AUTO` asks them top to bottom and the",
        "first eligible one serves a layer (RULES RQ3, LR1). Pin one with `moe_config.tactic` set to its",
        "shortest tactic, or select a backend with `moe_config.backend` (RULES TA, RQ).",
        "",
        "`SMs` are the GPUs an implementation is built for; `verified on` those of them where its tests",
        "have passed (the others are claimed, never run). `weights` says where quantized weights are",
        "dequantized.",
        "",
        "| priority | id | shortest tactic | backend | format | SMs | verified on | host CPU | weights | capabilities | shape constraints | runtime class |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for impl in registry.impls:
        sms = ", ".join(str(s) for s in sorted(impl.sms))
        verified = ", ".join(str(s) for s in sorted(impl.verified_sms)) or "no GPU"
        cons = f"hidden % {impl.constraints.hidden_multiple}, intermediate shard % {impl.constraints.intermediate_multiple}"
        lines.append(
            f"| {impl.priority} | `{impl.id}` | `{shortest_query(impl.id, registry)}` | {impl.backend} | {impl.format} "
            f"| {sms} | {verified} | {'yes' if impl.cpu else 'no'} | {_cell(impl.weights_text)} | {_caps(impl)} | {cons} "
            f"| `{impl.class_path}` |"
        )
    lines += ["", "## Backend literals (`moe_config.backend`)", "", "| literal | meaning |", "|---|---|"]
    lines.append(f"| `{AUTO}` | every implementation in priority order (a preference, not a pin) |")
    for backend in registry.backends:
        if backend.fallback:
            how = "its implementations; it is the fallback of the other backends"
        elif backend.never_degrades:
            how = "its implementations only: it never degrades"
        else:
            how = f"its implementations, then the fallback backend {registry.fallback_backend}"
        lines.append(f"| `{backend.name}` | {_cell(backend.doc)} Requests {how}. |")
    lines += ["", "## MXFP4 run formats per SM (RULES FN2)", "", "| SM | most preferred first |", "|---|---|"]
    for sm, formats in registry.mxfp4_run_formats:
        lines.append(f"| sm_{sm} | {', '.join(formats)} |")
    return "\n".join(lines) + "\n"

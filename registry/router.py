"""Pick the build that serves a deployment: a target's specialized build, or the model's generic build.

Pure: it reads the generated index's literals and the resolution code, so `generated.load_model`
decides (and `explain` narrates) without importing torch (RULES TG5, TG6). A specialized build is
pre-bound, so it serves only a selection it claims *and* resolves to exactly the implementations
it was built with; anything else goes to the generic build (`auto`), or fails naming the criterion
that did not match (`require`). `off` always uses the generic build.
"""

from __future__ import annotations

from dataclasses import dataclass

from registry.errors import NotHonoredError, SelectionError
from registry.families import MoeShape
from registry.formats import LayerFormat
from registry.model import NON_NEURAL_MODES, DraftFacts, ModelFacts, MoeSite
from registry.model_resolve import ANY, ModelResolution, resolve_model, span
from registry.selection import Selection

MODES = ("auto", "require", "off")


def facts_from_literal(data: dict) -> ModelFacts:
    """Rebuild `ModelFacts` from the plain literal a generated `facts.py` holds."""

    def sites(rows):
        return tuple(MoeSite(layer, module, LayerFormat(fmt, source, excluded)) for layer, module, fmt, source, excluded in rows)

    def shape(value):
        return MoeShape(**value) if value is not None else None

    return ModelFacts(
        model=data["model"],
        family=data["family"],
        checkpoint=data["checkpoint"],
        shape=shape(data["shape"]),
        sites=sites(data["sites"]),
        excluded_layers=data["excluded_layers"],
        drafts=tuple(
            DraftFacts(d["name"], d["kind"], tuple(d["modes"]), sites(d["sites"]), shape(d["shape"]), d["vanilla_with_target"])
            for d in data["drafts"]
        ),
    )


def facts_to_literal(facts: ModelFacts) -> dict:
    def sites(items):
        return [[s.layer, s.module, s.format.format, s.format.source, s.format.excluded] for s in items]

    def shape(value):
        return None if value is None else {k: getattr(value, k) for k in MoeShape.__dataclass_fields__}

    return {
        "model": facts.model,
        "family": facts.family,
        "checkpoint": facts.checkpoint,
        "shape": shape(facts.shape),
        "sites": sites(facts.sites),
        "excluded_layers": facts.excluded_layers,
        "drafts": [
            {"name": d.name, "kind": d.kind, "modes": list(d.modes), "sites": sites(d.sites), "shape": shape(d.shape), "vanilla_with_target": d.vanilla_with_target}
            for d in facts.drafts
        ],
    }


def bound_layers(resolution: ModelResolution) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(role, layers, implementation id) per layer kind: what a build binds."""
    return tuple((r.role, tuple(r.layers), r.winner) for r in resolution.reports)


@dataclass(frozen=True)
class Route:
    kind: str                     # "specialized" | "generic"
    target: str | None
    module: str
    reasons: tuple[str, ...]      # why no specialized build serves (shown under auto)
    resolution: ModelResolution


def route(
    index: dict,
    facts: ModelFacts,
    sm: int,
    parallel: str,
    layout: tuple[int, int, int, int],
    selection: Selection,
    mode: str = "auto",
) -> Route:
    """Choose the build for (model, checkpoint, SM, parallel) under `selection` (TG5, TG6)."""
    if mode not in MODES:
        raise SelectionError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    model = index["models"][facts.model]
    tp, moe_tp, ep, dp = layout

    def generic() -> ModelResolution:
        # Resolved only when the generic build serves: a specialized route has resolved already.
        return resolve_model(facts, selection, sm, moe_tp, ep)

    key = (facts.model, facts.checkpoint, sm, parallel)
    targets = [t for t in index["targets"] if (t["model"], t["checkpoint"], t["sm"], t["parallel"]) == key]
    if mode == "off":
        return Route("generic", None, model["generic"], ("mode off: always the generic build",), generic())
    if not targets:
        declared = ", ".join(t["name"] for t in index["targets"] if t["model"] == facts.model) or "none"
        reason = f"no target of {facts.model} is declared for checkpoint {facts.checkpoint} on sm_{sm} with parallel {parallel} (declared: {declared})"
        return _generic_or_fail(mode, model, (reason,), generic)
    target = targets[0]
    honored = _honored(target["moe_impls_honored"])
    draft_honored = _honored(target["draft_moe_impls_honored"])
    claimed = resolve_model(facts, selection, sm, moe_tp, ep, honored=honored, draft_honored=draft_honored)
    reasons = list(f"{target['name']}: {r}" for r in claimed.refusals)
    if not reasons:
        reasons += _binding_mismatch(target, claimed, selection)
    if reasons:
        return _generic_or_fail(mode, model, tuple(reasons), generic)
    return Route("specialized", target["name"], target["module"], (), claimed)


def _honored(value):
    if value is None or value == ANY:
        return value
    return frozenset(value)


def _binding_mismatch(target: dict, claimed: ModelResolution, selection: Selection) -> list[str]:
    """A claimed selection must also resolve to what the build was pre-bound to."""
    built = {tuple(b[1]): b[2] for b in target["bound"] if b[0] != "draft"}
    now = {layers: impl for role, layers, impl in bound_layers(claimed) if role != "draft"}
    reasons = []
    if built != now:
        reasons.append(f"{target['name']} is built with {_describe(built)}; this selection resolves to {_describe(now)}")
    if selection.spec_mode is not None and selection.spec_mode not in NON_NEURAL_MODES:
        built_draft = {tuple(b[1]): b[2] for b in target["bound"] if b[0] == "draft"}
        now_draft = {layers: impl for role, layers, impl in bound_layers(claimed) if role == "draft"}
        if target["spec_mode"] != selection.spec_mode or built_draft != now_draft:
            what = f"its draft for speculative_config.mode {target['spec_mode']!r} ({_describe(built_draft)})" if target["spec_mode"] else "no draft"
            reasons.append(f"{target['name']} is built with {what}; this selection needs mode {selection.spec_mode!r} ({_describe(now_draft)})")
    return reasons


def _describe(bound: dict) -> str:
    return "; ".join(f"{impl} for layers {span(layers)}" for layers, impl in sorted(bound.items())) or "nothing"


def _generic_or_fail(mode: str, model: dict, reasons: tuple[str, ...], generic) -> Route:
    if mode == "require":
        raise NotHonoredError("mode require: no specialized build serves this deployment: " + "; ".join(reasons) + " (RULES TG5)")
    return Route("generic", None, model["generic"], reasons, generic())

"""What a generic build asks when it loads: every layer's implementation for this checkpoint, SM, layout
and selection, through the same resolution the generator runs (RULES GN1, TG5).

The one place registry and runtime meet: the generic build passes its inlined facts in and imports
the class paths it gets back. Pure: no torch, no pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import Layout
from registry.errors import SelectionError
from registry.impls import load_registry
from registry.model import facts_from_literal, layout_of
from registry.model_resolve import ModelResolution, resolve_model
from registry.selection import Selection


@dataclass(frozen=True)
class GenericBuild:
    layout: tuple[int, int, int, int]               # tp, moe_tp, ep, dp
    layers: tuple[str | None, ...]                  # per decoder layer: bound id, None = dense
    draft_layers: tuple[tuple[int, str], ...]       # (layer index, bound id) of the draft's MoE layers
    implementations: dict[str, tuple[str, str]]     # id -> (class path, backend)
    cpu_impls: tuple[str, ...]
    resolution: ModelResolution


def resolve_build(facts_by_checkpoint: dict, profiles: dict, checkpoint: str, sm: int, parallel: str, num_layers: int,
                  selection: Selection | None = None) -> GenericBuild:
    if checkpoint not in facts_by_checkpoint:
        raise SelectionError(f"no checkpoint {checkpoint!r}; declared: {', '.join(sorted(facts_by_checkpoint))}")
    registry = load_registry()
    facts = facts_from_literal(facts_by_checkpoint[checkpoint])
    layout = layout_of(parallel, {k: Layout(*v) for k, v in profiles.items()})
    resolution = resolve_model(facts, selection or Selection(), sm, layout.moe_tp, layout.ep, registry)
    layers: list[str | None] = [None] * num_layers
    draft = []
    for report in resolution.reports:
        for i in report.layers:
            if report.role == "draft":
                draft.append((i, report.winner))
            else:
                layers[i] = report.winner
    ids = {r.winner for r in resolution.reports}
    implementations = {i: (registry.impl(i).class_path, registry.impl(i).backend) for i in sorted(ids)}
    cpu = tuple(i for i in sorted(ids) if registry.impl(i).cpu)
    return GenericBuild(layout.as_tuple(), tuple(layers), tuple(sorted(draft)), implementations, cpu, resolution)

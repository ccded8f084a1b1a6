"""Model-level resolution: every MoE layer kind of a model under a selection, on one target's SM and
layout, and whether that target's honored ids claim it.

Rules: FN2-FN5 (formats under a tactic), LR (via `registry.resolve`), DR1-DR7 (drafts,
`registry.draft_resolve`), TG3-TG4 (honored ids). Errors (`ResolutionError`) mean no build of this
model can serve the selection here; refusals mean this target does not claim it and the generic build
serves instead (TG5). The layer kinds of one side resolve in `registry.model_layers`; what a pinned
tactic must cover, and the tactic to use instead, is `registry.tactic_advice`.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import Honored
from registry.draft_resolve import resolve_draft
from registry.eligibility import Deployment
from registry.impls import Registry, load_registry
from registry.layer_task import Findings, groups
from registry.model import ModelFacts
from registry.model_layers import layer_task, resolve_side
from registry.resolve import LayerReport, Request, moe_impl_request
from registry.selection import TARGET_BACKEND, TARGET_TACTIC, Selection, check_selection


@dataclass(frozen=True)
class ModelResolution:
    """What a selection resolves to on one SM and layout; `refusals` is empty when the target claims it."""

    model: str
    checkpoint: str
    sm: int
    reports: tuple[LayerReport, ...]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()

    @property
    def claimed(self) -> bool:
        return not self.refusals

    def bound_ids(self, role: str | None = None) -> tuple[str, ...]:
        return tuple(sorted({r.winner for r in self.reports if role is None or (r.role == "draft") == (role == "draft")}))


def resolve_model(
    facts: ModelFacts,
    selection: Selection,
    sm: int,
    moe_tp: int = 1,
    ep: int = 1,
    registry: Registry | None = None,
    honored: Honored | None = None,
    draft_honored: Honored | None = None,
) -> ModelResolution:
    """Resolve every MoE layer kind of `facts` under `selection` on sm_`sm` with the given MoE split:
    for the generic build by default (no honored ids constrain or refuse it), for a target when its
    honored ids are given."""
    registry = registry or load_registry()
    selection = check_selection(selection, registry)
    deployment = Deployment(sm=sm, moe_tp=moe_tp, ep=ep, eplb=selection.eplb)
    out = Findings()

    target = _target_request(selection, registry)
    backend = moe_impl_request(selection.backend, eplb=selection.eplb, registry=registry, field=TARGET_BACKEND)
    tasks = []
    for group in groups(facts.sites, "target"):
        request, warning = target, None
        if group.role == "excluded" and target.pinned and facts.excluded_layers == "backend":
            request = backend
            warning = (
                f"{group.describe()} run bf16 (excluded from quantization) and build under {backend.asked}, "
                f"skipping {target.asked} (RULES FN5)"
            )
        tasks.append(layer_task(group, request, sm, registry, warning))
    target_reports = resolve_side(tasks, facts.shape, deployment, registry, honored, "moe_impls_honored", out)
    draft_reports = resolve_draft(facts, selection, deployment, registry, draft_honored, target_reports, out)
    return ModelResolution(
        model=facts.model,
        checkpoint=facts.checkpoint,
        sm=sm,
        reports=tuple(target_reports + draft_reports),
        notes=tuple(out.notes),
        warnings=tuple(out.warnings),
        refusals=tuple(out.refusals),
    )


def _target_request(selection: Selection, registry: Registry) -> Request:
    if selection.tactic is not None:
        return moe_impl_request(selection.tactic, eplb=selection.eplb, registry=registry, field=TARGET_TACTIC)
    return moe_impl_request(selection.backend, eplb=selection.eplb, registry=registry, field=TARGET_BACKEND)

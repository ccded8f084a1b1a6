"""A model's draft side under a selection: which draft serves the speculative mode, the request its MoE layers resolve under, and the VANILLA-with-target rule (RULES DR1-DR7)."""

from __future__ import annotations

from dataclasses import replace

from contract import Honored
from registry.eligibility import Deployment
from registry.errors import ResolutionError, SelectionError
from registry.impls import AUTO, Registry
from registry.layer_task import Findings, groups
from registry.model import NON_NEURAL_MODES, ModelFacts
from registry.model_layers import layer_task, resolve_side
from registry.resolve import LayerReport, Request, moe_impl_request
from registry.selection import DRAFT_BACKEND, DRAFT_TACTIC, TARGET_BACKEND, TARGET_TACTIC, Selection


def resolve_draft(facts: ModelFacts, selection: Selection, deployment: Deployment, registry: Registry,
                  honored: Honored | None, target_reports: list[LayerReport], out: Findings) -> list[LayerReport]:
    """The draft layers' reports for the selection's speculative mode (none without a neural drafter)."""
    mode = selection.spec_mode
    if mode in NON_NEURAL_MODES:
        ignored = [f for f, v in ((DRAFT_BACKEND, selection.draft_backend), (DRAFT_TACTIC, selection.draft_tactic)) if v is not None]
        what = f"{' and '.join(ignored)} ignored" if ignored else "no draft MoE layers to select"
        out.notes.append(f"speculative_config.mode {mode!r} has no neural drafter: {what} (RULES DR4)")
        return []
    if mode is None:
        return []
    draft = facts.draft_for(mode)
    if draft is None:
        served = sorted({m for d in facts.drafts for m in d.modes})
        raise SelectionError(
            f"{facts.model} has no draft for speculative_config.mode {mode!r}; its drafts serve: "
            f"{', '.join(served) or 'none'}"
        )
    if not draft.sites:
        out.notes.append(f"draft {draft.name} ({draft.kind}) has no MoE layers: the draft MoE fields select nothing")
        return []
    request = _draft_request(selection, draft.registers_into_target_balancer, registry, out)
    tasks = [layer_task(g, request, deployment.sm, registry) for g in groups(draft.sites, "draft")]
    # DR6: only a draft in the target's load balancer runs under its EPLB plans; an external
    # drafter's candidates must not be turned down EPLB_UNSUPPORTED for the target's EPLB.
    draft_deployment = replace(deployment, eplb=request.eplb)
    reports = resolve_side(tasks, draft.shape, draft_deployment, registry, honored, "draft_moe_impls_honored", out)
    if draft.vanilla_with_target:
        _check_vanilla_with_target(facts, draft.name, target_reports, reports, registry)
    return reports


def _draft_request(selection: Selection, balanced: bool, registry: Registry, out: Findings) -> Request:
    """DR1: the draft tactic pins, else the draft backend selects, else inherit (DR6: EPLB as the target)."""
    eplb = selection.eplb and balanced
    if selection.draft_tactic is not None:
        return moe_impl_request(selection.draft_tactic, eplb=eplb, registry=registry, field=DRAFT_TACTIC)
    if selection.draft_backend is not None:
        return moe_impl_request(selection.draft_backend, eplb=eplb, registry=registry, field=DRAFT_BACKEND)
    if selection.tactic is not None:
        out.notes.append(
            f"the draft resolves AUTO for its own weights: {TARGET_TACTIC} pins the target only and "
            f"{DRAFT_BACKEND}/{DRAFT_TACTIC} are unset (RULES DR1)"
        )
        return moe_impl_request(AUTO, eplb=eplb, registry=registry, field=DRAFT_BACKEND)
    out.notes.append(f"the draft inherits {TARGET_BACKEND} {selection.backend!r} ({DRAFT_BACKEND} is unset) (RULES DR1)")
    return moe_impl_request(selection.backend, eplb=eplb, registry=registry, field=DRAFT_BACKEND)


def _check_vanilla_with_target(facts: ModelFacts, draft: str, target_reports, draft_reports, registry: Registry) -> None:
    """DR5: the embedded MTP runs VANILLA exactly when the target does."""
    never = {b.name for b in registry.backends if b.never_degrades}
    target_vanilla = any(r.backend in never for r in target_reports if r.role == "target")
    draft_vanilla = any(r.backend in never for r in draft_reports)
    if target_vanilla != draft_vanilla:
        t = ", ".join(sorted({r.winner for r in target_reports if r.role == "target"}))
        d = ", ".join(sorted({r.winner for r in draft_reports}))
        raise ResolutionError(
            f"{facts.model}: the embedded MTP of {draft} must run {'/'.join(sorted(never))} exactly when the target does "
            f"(its checkpoint weight mapping differs only there); the target runs {t}, the draft would run {d}; "
            f"select the draft with {DRAFT_BACKEND} or {DRAFT_TACTIC} so that both or neither run {'/'.join(sorted(never))} (RULES DR5)"
        )

"""One side of a model (its target layers or its draft's) resolved layer kind by layer kind: run formats, the pinned tactic's checks, honored ids, then each kind's candidates (RULES FN2-FN4, LR1-LR4, TG3, TG4)."""

from __future__ import annotations

from contract import Honored, MoeShape
from registry.eligibility import Deployment, Problem
from registry.errors import ResolutionError
from registry.formats import run_format
from registry.impls import Registry
from registry.layer_task import Findings, Group, LayerTask
from registry.resolve import FALLBACK, LayerReport, Request, ask_candidates, no_winner_message
from registry.tactic_advice import check_tactic_covers, check_tactic_honored


def layer_task(group: Group, request: Request, sm: int, registry: Registry, warning: str | None = None) -> LayerTask:
    """The task of resolving `group` under `request` on sm_`sm`: its run format decided first (FN2-FN4)."""
    fmt, source = run_format(group.checkpoint_format, request.candidates, sm, registry, request.asked)
    return LayerTask(group, request, fmt, source, warning)


def resolve_side(tasks: list[LayerTask], shape: MoeShape | None, deployment: Deployment, registry: Registry,
                 honored: Honored | None, honored_field: str, out: Findings) -> list[LayerReport]:
    """The pinned tactic's coverage (FN3, FN4) and honored ids (TG3) on a target (`honored` None: no
    target, the generic build), then each task's candidates (LR1-LR4, TG4)."""
    pinned = [t for t in tasks if t.request.pinned]
    for task in pinned:
        check_tactic_covers(task, pinned, shape, deployment, registry)
    if pinned and honored is not None:
        check_tactic_honored(pinned, deployment.sm, honored, honored_field, out)
    return [_report(task, shape, deployment, registry, honored, out) for task in tasks]


def _report(task: LayerTask, shape: MoeShape | None, deployment: Deployment, registry: Registry, honored: Honored | None,
            out: Findings) -> LayerReport:
    request, fmt, group = task.request, task.run_format, task.group
    problem = Problem.of(fmt, shape)
    restrict = None if request.pinned or honored is None else honored.restricts
    outcome = ask_candidates(request, problem, deployment, restrict)
    what = task.where(deployment.sm)
    if outcome.winner is None and restrict is not None:
        free = ask_candidates(request, problem, deployment, None)
        if free.winner is not None:
            out.refusals.append(
                f"{request.asked}: no eligible honored implementation for {what}; it would run "
                f"{free.winner.id}, and this target honors {honored.describe()} (RULES TG4)"
            )
            outcome = free
    if outcome.winner is None:
        raise ResolutionError(no_winner_message(request, outcome, what, fmt=fmt, registry=registry))
    warnings = (task.warning,) if task.warning else ()
    if outcome.selected_by == FALLBACK:
        # The backend's own rejections; a backend with no implementation of this format has none,
        # and the warning says so instead of ending in an empty list.
        trail = "; ".join(r.describe() for r in outcome.rejections if registry.impl(r.impl).backend != registry.fallback_backend)
        trail = trail or f"{request.requested} has no {fmt} implementation"
        degraded = (
            f"{request.asked}: no {request.requested} implementation can serve {what}; degraded to "
            f"{outcome.winner.id} ({outcome.winner.backend}): {trail} (RULES LR4)"
        )
        warnings += (degraded,)
    out.warnings.extend(warnings)
    winner = outcome.winner
    return LayerReport(
        role=group.role,
        layers=group.layers,
        checkpoint_format=group.checkpoint_format,
        format_source=group.source,
        run_format=fmt,
        run_format_source=task.run_format_source,
        requested=request.requested,
        field=request.field,
        winner=str(winner.id),
        winner_class=winner.class_path,
        backend=winner.backend,
        selected_by=outcome.selected_by,
        weights=winner.weights_text,
        verification=winner.verification(deployment.sm),
        alternatives=tuple(str(i.id) for i in outcome.eligible if i is not winner),
        rejections=outcome.rejections,
        warnings=warnings,
    )

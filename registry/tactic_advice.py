"""What a pinned tactic must cover before its layers resolve, and the tactic to use instead when it does not (RULES FN3, FN4, TG3).

A tactic pins every layer kind of its side: it must name implementations of each kind's run format
(FN4), of one backend per format (FN3), and, on a target, only honored ones (TG3). A refusal names the
nearest tactic that would pass: widened (FN4) or narrowed (FN3) by the fewest segments.
"""

from __future__ import annotations

import itertools

from contract import Honored, MoeShape
from registry.eligibility import Deployment, Problem
from registry.errors import MoegenError, ResolutionError
from registry.formats import run_format
from registry.identity import FIELDS
from registry.impls import Impl, Registry
from registry.layer_task import Findings, LayerTask
from registry.resolve import Request, ask_candidates, moe_impl_request
from registry.selection import DRAFT_BACKEND, TARGET_BACKEND, TARGET_TACTIC
from registry.tactics import matching_impls, shortest_query


def resolvable(impl: Impl, sm: int, eplb: bool) -> bool:
    """Whether a layer on sm_`sm` can ever resolve to `impl`: it runs there and, under per-layer
    dynamic EPLB, consumes the plans (RQ4).

    FN3/FN4/TG3 count only these: under EPLB, counting implementations EPLB always turns down would
    refuse e.g. 'w4a16_mxfp4' as spanning TORCH and VANILLA and suggest a VANILLA tactic RQ4 refuses.
    """
    return impl.runs_on(sm) and (not eplb or impl.capabilities.dynamic_eplb)


def _runnable(request: Request, fmt: str, sm: int) -> tuple[Impl, ...]:
    """The tactic's matches narrowed to a run format and to what the layer can resolve to on the SM."""
    return tuple(i for i in request.candidates if i.format == fmt and resolvable(i, sm, request.eplb))


def check_tactic_covers(task: LayerTask, pinned: list[LayerTask], shape: MoeShape | None, deployment: Deployment,
                        registry: Registry) -> None:
    """FN4 (the tactic names the layer's format) and FN3 (one backend per format)."""
    sm, request, fmt, group = deployment.sm, task.request, task.run_format, task.group
    matches = _runnable(request, fmt, sm)
    where = f"{group.describe()} ({group.source})"
    if not matches and any(i.format == fmt for i in request.candidates):
        # The tactic names implementations of this format that cannot run here: resolution turns each
        # down with its own reason (SM_UNSUPPORTED, EPLB_UNSUPPORTED), which says more than FN4 would.
        return
    if not matches:
        serving = [i for i in registry.impls if i.format == fmt and resolvable(i, sm, request.eplb)]
        listed = ", ".join(f"{i.id} ({shortest_query(i.id, registry)!r})" for i in serving) or "no registered implementation"
        raise ResolutionError(
            f"{request.asked} names no implementation of {fmt} on sm_{sm}, the format of {where}; "
            f"{fmt} is served by {listed}; {_widened(request, pinned, shape, deployment, registry)} (RULES FN4)"
        )
    backends = sorted({i.backend for i in matches})
    if len(backends) > 1:
        pins = ", ".join(f"{_narrowed(request, fmt, name, sm, registry)!r} ({name})" for name in backends)
        raise ResolutionError(
            f"{request.asked} names implementations of {len(backends)} backends for {fmt} ({where}): "
            f"{', '.join(backends)}; pin one backend: {pins} (RULES FN3)"
        )


def _accepted(tactic, request: Request, pinned: list[LayerTask], shape, deployment: Deployment, registry: Registry) -> str | None:
    """The backend of a tactic that resolution accepts for every pinned layer kind, or None.

    Accepted means what resolving it checks, for the run format each layer kind would have under
    this tactic: its runnable implementations of that format are all of one backend (FN3, FN4), one
    backend for every kind, and one of them passes every eligibility gate (LR1).
    """
    sm = deployment.sm
    try:
        wider = moe_impl_request(tactic, eplb=request.eplb, registry=registry, field=request.field)
        backends = set()
        for task in pinned:
            fmt = run_format(task.group.checkpoint_format, wider.candidates, sm, registry, wider.asked)[0]
            backends |= {i.backend for i in _runnable(wider, fmt, sm)} or {None}
            if ask_candidates(wider, Problem.of(fmt, shape), deployment).winner is None:
                return None
    except MoegenError:
        return None
    return backends.pop() if len(backends) == 1 and None not in backends else None


def _widened(request: Request, pinned: list[LayerTask], shape, deployment: Deployment, registry: Registry) -> str:
    """FN4: the tactic widened by dropping the fewest segments so one backend covers every format."""
    tactic = request.tactic
    tokens = list(tactic.pinned())
    needed = ", ".join(sorted({t.run_format for t in pinned}))
    for drop in range(1, len(tokens)):
        for fields in itertools.combinations(tokens, drop):
            wider = tactic.with_fields(**{f: None for f in fields})
            backend = _accepted(wider.text, request, pinned, shape, deployment, registry)
            if backend:
                return f"{wider.compact!r} covers {needed} within {backend}"
    return f"no tactic of one backend covers {needed}: select by backend ({TARGET_BACKEND if request.field == TARGET_TACTIC else DRAFT_BACKEND}) instead"


def _narrowed(request: Request, fmt: str, backend: str, sm: int, registry: Registry) -> str:
    """FN3: the tactic narrowed by the fewest segments so that, for `fmt`, it names only `backend`."""
    tactic = request.tactic
    own = [i for i in _runnable(request, fmt, sm) if i.backend == backend]
    open_fields = [f for f in FIELDS if getattr(tactic, f) is None]
    for size in range(1, len(open_fields) + 1):
        for fields in itertools.combinations(open_fields, size):
            for impl in own:
                narrower = tactic.with_fields(**{f: impl.id.segment(f) for f in fields})
                names = {i.backend for i in matching_impls(narrower, registry) if i.format == fmt and resolvable(i, sm, request.eplb)}
                if names == {backend}:
                    return narrower.compact
    return str(own[0].id)


def check_tactic_honored(pinned: list[LayerTask], sm: int, honored: Honored, honored_field: str, out: Findings) -> None:
    """TG3: honored when every implementation the tactic can resolve to is in the honored set."""
    reached: dict[str, list[LayerTask]] = {}
    for task in pinned:
        for impl in _runnable(task.request, task.run_format, sm):
            reached.setdefault(str(impl.id), []).append(task)
    outside = {i: tasks for i, tasks in reached.items() if not honored.allows(i)}
    if not outside:
        return
    parts = [f"{impl_id} for the {', '.join(t.where(sm) for t in tasks)}" for impl_id, tasks in sorted(outside.items())]
    if honored.declared:
        reason = f"this target honors {honored.describe()} (RULES TG3)"
    else:
        reason = f"this target declares no {honored_field}, so it honors no tactic (RULES TG2)"
    out.refusals.append(f"{pinned[0].request.asked} resolves to {'; '.join(parts)}; {reason}")

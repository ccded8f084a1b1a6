"""Model-level resolution: every MoE layer kind of a model under a selection, on one target's SM and
layout, and whether that target's honored ids claim it.

Rules: FN2-FN5 (formats under a tactic), LR (via `registry.resolve`), DR1-DR7 (drafts), TG3-TG4
(honored ids). Errors (`ResolutionError`) mean no build of this model can serve the selection here;
refusals mean this target does not claim it and the generic build serves instead (TG5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from registry.eligibility import Deployment, Problem
from registry.errors import MoegenError, ResolutionError, SelectionError
from registry.families import MoeShape
from registry.formats import run_format
from registry.identity import FIELDS
from registry.impls import AUTO, Impl, Registry, load_registry
from registry.model import NON_NEURAL_MODES, ModelFacts, MoeSite
from registry.resolve import FALLBACK, LayerReport, Request, ask_candidates, moe_impl_request, no_winner_message
from registry.selection import (
    DRAFT_BACKEND,
    DRAFT_TACTIC,
    TARGET_BACKEND,
    TARGET_TACTIC,
    Selection,
    check_selection,
)
from registry.tactics import matching_impls, shortest_query

ANY = "*"
# The honored ids of no target: the generic build's resolution, which no honored set constrains or
# refuses (a target nobody declared refuses nothing).
NO_TARGET = "(no target)"
# How messages and `explain` name a layer kind.
ROLE_NAMES = {"target": "routed", "excluded": "excluded", "draft": "draft"}
Honored = frozenset | str | None   # a list of ids, ANY, NO_TARGET, or None when the target declares nothing (TG2)


@dataclass(frozen=True)
class Group:
    """Layers that resolve together: same role and checkpoint format."""

    role: str                     # "target" | "excluded" | "draft"
    checkpoint_format: str
    sources: tuple[str, ...]
    layers: tuple[int, ...]

    @property
    def source(self) -> str:
        return "; ".join(self.sources)

    def describe(self) -> str:
        return f"{ROLE_NAMES[self.role]} layers {span(self.layers)}"


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


def span(layers: tuple[int, ...]) -> str:
    """`1-92`, or `3, 7, 11` when not contiguous."""
    if len(layers) > 1 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(str(i) for i in layers)


def resolve_model(
    facts: ModelFacts,
    selection: Selection,
    sm: int,
    moe_tp: int = 1,
    ep: int = 1,
    registry: Registry | None = None,
    honored: Honored = NO_TARGET,
    draft_honored: Honored = NO_TARGET,
) -> ModelResolution:
    """Resolve every MoE layer kind of `facts` under `selection` on sm_`sm` with the given MoE split:
    for the generic build by default, for a target when its honored ids are given."""
    registry = registry or load_registry()
    selection = check_selection(selection, registry)
    deployment = Deployment(sm=sm, moe_tp=moe_tp, ep=ep, eplb=selection.eplb)
    out = _Collector()

    target = _target_request(selection, registry)
    backend = moe_impl_request(selection.backend, eplb=selection.eplb, registry=registry, field=TARGET_BACKEND)
    plans = []
    for group in _groups(facts.sites, "target"):
        request, warning = target, None
        if group.role == "excluded" and target.pinned and facts.excluded_layers == "backend":
            request = backend
            warning = (
                f"{group.describe()} run bf16 (excluded from quantization) and build under {backend.asked}, "
                f"skipping {target.asked} (RULES FN5)"
            )
        plans.append((group, request, warning))
    target_reports = _resolve_side(plans, facts.shape, deployment, registry, honored, "moe_impls_honored", out)

    draft_reports: list[LayerReport] = []
    mode = selection.spec_mode
    if mode in NON_NEURAL_MODES:
        ignored = [f for f, v in ((DRAFT_BACKEND, selection.draft_backend), (DRAFT_TACTIC, selection.draft_tactic)) if v is not None]
        what = f"{' and '.join(ignored)} ignored" if ignored else "no draft MoE layers to select"
        out.notes.append(f"speculative_config.mode {mode!r} has no neural drafter: {what} (RULES DR4)")
    elif mode is not None:
        draft = facts.draft_for(mode)
        if draft is None:
            served = sorted({m for d in facts.drafts for m in d.modes})
            raise SelectionError(
                f"{facts.model} has no draft for speculative_config.mode {mode!r}; its drafts serve: "
                f"{', '.join(served) or 'none'}"
            )
        if not draft.sites:
            out.notes.append(f"draft {draft.name} ({draft.kind}) has no MoE layers: the draft MoE fields select nothing")
        else:
            request = _draft_request(selection, draft.registers_into_target_balancer, registry, out)
            plans = [(g, request, None) for g in _groups(draft.sites, "draft")]
            # DR6: only a draft in the target's load balancer runs under its EPLB plans; an external
            # drafter's candidates must not be turned down EPLB_UNSUPPORTED for the target's EPLB.
            draft_deployment = replace(deployment, eplb=request.eplb)
            draft_reports = _resolve_side(plans, draft.shape, draft_deployment, registry, draft_honored, "draft_moe_impls_honored", out)
            if draft.vanilla_with_target:
                _check_vanilla_with_target(facts, draft.name, target_reports, draft_reports, registry)

    return ModelResolution(
        model=facts.model,
        checkpoint=facts.checkpoint,
        sm=sm,
        reports=tuple(target_reports + draft_reports),
        notes=tuple(out.notes),
        warnings=tuple(out.warnings),
        refusals=tuple(out.refusals),
    )


@dataclass
class _Collector:
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def _target_request(selection: Selection, registry: Registry) -> Request:
    if selection.tactic is not None:
        return moe_impl_request(selection.tactic, eplb=selection.eplb, registry=registry, field=TARGET_TACTIC)
    return moe_impl_request(selection.backend, eplb=selection.eplb, registry=registry, field=TARGET_BACKEND)


def _draft_request(selection: Selection, balanced: bool, registry: Registry, out: _Collector) -> Request:
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


def _groups(sites: tuple[MoeSite, ...], role: str) -> list[Group]:
    keyed: dict[tuple[str, str], list[MoeSite]] = {}
    for site in sites:
        kind = "excluded" if (role == "target" and site.format.excluded) else role
        keyed.setdefault((kind, site.format.format), []).append(site)
    order = {"target": 0, "excluded": 1, "draft": 2}
    groups = [
        Group(kind, fmt, tuple(sorted({s.format.source for s in members})), tuple(sorted(s.layer for s in members)))
        for (kind, fmt), members in keyed.items()
    ]
    return sorted(groups, key=lambda g: (order[g.role], g.layers[0]))


def _resolve_side(plans, shape: MoeShape | None, deployment: Deployment, registry: Registry, honored: Honored, honored_field: str, out: _Collector) -> list[LayerReport]:
    """Formats (FN2-FN4), honored ids (TG3/TG4), then each group's candidates (LR1-LR4)."""
    formats = {g: run_format(g.checkpoint_format, req.candidates, deployment.sm, registry, req.asked) for g, req, _ in plans}
    pinned = [(g, req) for g, req, _ in plans if req.pinned]
    for group, request in pinned:
        _check_tactic_covers(group, request, formats, pinned, shape, deployment, registry)
    if pinned and honored != NO_TARGET:
        _check_tactic_honored(pinned, formats, deployment.sm, honored, honored_field, registry, out)

    reports = []
    for group, request, warning in plans:
        fmt, fmt_note = formats[group]
        problem = layer_problem(fmt, shape)
        restrict = None if request.pinned else _restriction(honored)
        outcome = ask_candidates(request, problem, deployment, restrict)
        what = f"{group.describe()} (format {fmt} on sm_{deployment.sm})"
        if outcome.winner is None and restrict is not None:
            free = ask_candidates(request, problem, deployment, None)
            if free.winner is not None:
                out.refusals.append(
                    f"{request.asked}: no eligible honored implementation for {what}; it would run "
                    f"{free.winner.id}, and this target honors {_honored_text(honored)} (RULES TG4)"
                )
                outcome = free
        if outcome.winner is None:
            raise ResolutionError(no_winner_message(request, outcome, what, fmt=fmt, registry=registry))
        warnings = (warning,) if warning else ()
        if outcome.selected_by == FALLBACK:
            # The family's own rejections; a family with no implementation of this format has none,
            # and the warning says so instead of ending in an empty list.
            trail = "; ".join(r.describe() for r in outcome.rejections if registry.impl(r.impl).family != registry.fallback_family)
            trail = trail or f"{request.requested} has no {fmt} implementation"
            degraded = (
                f"{request.asked}: no {request.requested} implementation can serve {what}; degraded to "
                f"{outcome.winner.id} ({outcome.winner.family}): {trail} (RULES LR4)"
            )
            warnings += (degraded,)
        out.warnings.extend(warnings)
        winner = outcome.winner
        reports.append(
            LayerReport(
                role=group.role,
                layers=group.layers,
                checkpoint_format=group.checkpoint_format,
                format_source=group.source,
                run_format=fmt,
                run_format_source=fmt_note,
                requested=request.requested,
                field=request.field,
                winner=str(winner.id),
                winner_class=winner.class_path,
                family=winner.family,
                selected_by=outcome.selected_by,
                weights=winner.weights_text,
                verification=winner.verification(deployment.sm),
                alternatives=tuple(str(i.id) for i in outcome.eligible if i is not winner),
                rejections=outcome.rejections,
                warnings=warnings,
            )
        )
    return reports


def layer_problem(fmt: str, shape: MoeShape | None) -> Problem:
    if shape is None:
        return Problem(format=fmt)
    return Problem(
        format=fmt,
        activation=shape.activation,
        expert_bias=shape.expert_bias,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
    )


def _restriction(honored: Honored) -> frozenset | None:
    """TG4: a declared list restricts the winner; ANY or an undeclared side does not."""
    return honored if isinstance(honored, frozenset) else None


def _honored_text(honored: Honored) -> str:
    if honored is None:
        return "no tactic (it declares no honored ids)"
    if honored == ANY:
        return "any implementation"
    return "only " + ", ".join(sorted(honored)) if honored else "no implementation"


def _resolvable(impl: Impl, sm: int, eplb: bool) -> bool:
    """Whether a layer on sm_`sm` can ever resolve to `impl`: it runs there and, under per-layer
    dynamic EPLB, consumes the plans (RQ4).

    FN3/FN4/TG3 count only these: under EPLB, counting implementations EPLB always turns down would
    refuse e.g. 'w4a16_mxfp4' as spanning TORCH and VANILLA and suggest a VANILLA tactic RQ4 refuses.
    """
    return impl.runs_on(sm) and (not eplb or impl.capabilities.dynamic_eplb)


def _runnable(request: Request, fmt: str, sm: int) -> tuple[Impl, ...]:
    """The tactic's matches narrowed to a run format and to what the layer can resolve to on the SM."""
    return tuple(i for i in request.candidates if i.format == fmt and _resolvable(i, sm, request.eplb))


def _check_tactic_covers(group: Group, request: Request, formats, pinned, shape, deployment: Deployment, registry: Registry) -> None:
    """FN4 (the tactic names the layer's format) and FN3 (one family per format)."""
    sm = deployment.sm
    fmt = formats[group][0]
    matches = _runnable(request, fmt, sm)
    where = f"{group.describe()} ({group.source})"
    if not matches and any(i.format == fmt for i in request.candidates):
        # The tactic names implementations of this format that cannot run here: resolution turns each
        # down with its own reason (SM_UNSUPPORTED, EPLB_UNSUPPORTED), which says more than FN4 would.
        return
    if not matches:
        serving = [i for i in registry.impls if i.format == fmt and _resolvable(i, sm, request.eplb)]
        listed = ", ".join(f"{i.id} ({shortest_query(i.id, registry)!r})" for i in serving) or "no registered implementation"
        raise ResolutionError(
            f"{request.asked} names no implementation of {fmt} on sm_{sm}, the format of {where}; "
            f"{fmt} is served by {listed}; {_widened(request, pinned, formats, shape, deployment, registry)} (RULES FN4)"
        )
    families = sorted({i.family for i in matches})
    if len(families) > 1:
        pins = ", ".join(f"{_narrowed(request, fmt, fam, sm, registry)!r} ({fam})" for fam in families)
        raise ResolutionError(
            f"{request.asked} names implementations of {len(families)} families for {fmt} ({where}): "
            f"{', '.join(families)}; pin one family: {pins} (RULES FN3)"
        )


def _accepted(tactic, request: Request, pinned, shape, deployment: Deployment, registry: Registry) -> str | None:
    """The family of a tactic that resolution accepts for every pinned layer kind, or None.

    Accepted means what resolving it checks, for the run format each layer kind would have under
    this tactic: its runnable implementations of that format are all of one family (FN3, FN4), one
    family for every kind, and one of them passes every eligibility gate (LR1).
    """
    sm = deployment.sm
    try:
        wider = moe_impl_request(tactic, eplb=request.eplb, registry=registry, field=request.field)
        families = set()
        for group, _ in pinned:
            fmt = run_format(group.checkpoint_format, wider.candidates, sm, registry, wider.asked)[0]
            families |= {i.family for i in _runnable(wider, fmt, sm)} or {None}
            if ask_candidates(wider, layer_problem(fmt, shape), deployment).winner is None:
                return None
    except MoegenError:
        return None
    return families.pop() if len(families) == 1 and None not in families else None


def _widened(request: Request, pinned, formats, shape, deployment: Deployment, registry: Registry) -> str:
    """FN4: the tactic widened by dropping the fewest segments so one family covers every format."""
    tactic = request.tactic
    tokens = list(tactic.pinned())
    needed = ", ".join(sorted({formats[g][0] for g, _ in pinned}))
    for drop in range(1, len(tokens)):
        for fields in itertools.combinations(tokens, drop):
            wider = tactic.with_fields(**{f: None for f in fields})
            family = _accepted(wider.text, request, pinned, shape, deployment, registry)
            if family:
                return f"{wider.compact!r} covers {needed} within {family}"
    return f"no tactic of one family covers {needed}: select by backend ({TARGET_BACKEND if request.field == TARGET_TACTIC else DRAFT_BACKEND}) instead"


def _narrowed(request: Request, fmt: str, family: str, sm: int, registry: Registry) -> str:
    """FN3: the tactic narrowed by the fewest segments so that, for `fmt`, it names only `family`."""
    tactic = request.tactic
    own = [i for i in _runnable(request, fmt, sm) if i.family == family]
    open_fields = [f for f in FIELDS if getattr(tactic, f) is None]
    for size in range(1, len(open_fields) + 1):
        for fields in itertools.combinations(open_fields, size):
            for impl in own:
                narrower = tactic.with_fields(**{f: impl.id.segment(f) for f in fields})
                names = {i.family for i in matching_impls(narrower, registry) if i.format == fmt and _resolvable(i, sm, request.eplb)}
                if names == {family}:
                    return narrower.compact
    return str(own[0].id)


def _check_tactic_honored(pinned, formats, sm: int, honored: Honored, honored_field: str, registry: Registry, out: _Collector) -> None:
    """TG3: honored when every implementation the tactic can resolve to is in the honored set."""
    if honored == ANY:
        return
    request = pinned[0][1]
    resolvable = {}
    for group, req in pinned:
        fmt = formats[group][0]
        for impl in _runnable(req, fmt, sm):
            resolvable.setdefault(str(impl.id), []).append((group, fmt))
    outside = {i: where for i, where in resolvable.items() if honored is None or i not in honored}
    if not outside:
        return
    parts = []
    for impl_id, where in sorted(outside.items()):
        groups = ", ".join(f"{g.describe()} (format {fmt} on sm_{sm})" for g, fmt in where)
        parts.append(f"{impl_id} for the {groups}")
    reason = "this target declares no " + honored_field + ", so it honors no tactic (RULES TG2)" if honored is None else f"this target honors {_honored_text(honored)} (RULES TG3)"
    out.refusals.append(f"{request.asked} resolves to {'; '.join(parts)}; {reason}")


def _check_vanilla_with_target(facts: ModelFacts, draft: str, target_reports, draft_reports, registry: Registry) -> None:
    """DR5: the embedded MTP runs VANILLA exactly when the target does."""
    never = {f.name for f in registry.families if f.never_degrades}
    target_vanilla = any(r.family in never for r in target_reports if r.role == "target")
    draft_vanilla = any(r.family in never for r in draft_reports)
    if target_vanilla != draft_vanilla:
        t = ", ".join(sorted({r.winner for r in target_reports if r.role == "target"}))
        d = ", ".join(sorted({r.winner for r in draft_reports}))
        raise ResolutionError(
            f"{facts.model}: the embedded MTP of {draft} must run {'/'.join(sorted(never))} exactly when the target does "
            f"(its checkpoint weight mapping differs only there); the target runs {t}, the draft would run {d}; "
            f"select the draft with {DRAFT_BACKEND} or {DRAFT_TACTIC} so that both or neither run {'/'.join(sorted(never))} (RULES DR5)"
        )

"""The one conversion point from a selection to implementations, and per-layer resolution.

`moe_impl_request` turns a backend literal or a tactic into an ordered list of candidates (RULES
RQ1-RQ4); the generator, the generic build, config validation, `explain`, the catalog and the schema
all read the request it returns. `resolve_layer` asks those candidates, in order, whether they can
serve one layer kind and reports the answer (LR1-LR5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contract import Honored
from registry.eligibility import Deployment, Problem, Reason, Rejection, eligibility
from registry.errors import SelectionError, TacticError
from registry.impls import AUTO, Impl, Registry, load_registry
from registry.tactics import Tactic, matching_impls, parse_tactic

PINNED, PREFERRED, FALLBACK = "pinned", "preferred", "fallback"


@dataclass(frozen=True)
class Request:
    """Candidates in the order they are asked; `candidates[own:]` are the fallback backend's (RQ1)."""

    kind: str                     # "auto" | "backend" | "tactic"
    requested: str                # canonical: "AUTO", a literal, or the tactic's full-width form
    field: str                    # the config field that set it, for messages (LR3)
    candidates: tuple[Impl, ...]
    own: int
    tactic: Tactic | None = None
    eplb: bool = False

    @property
    def pinned(self) -> bool:
        """A tactic is a pin: it never falls back (RQ2)."""
        return self.kind == "tactic"

    @property
    def asked(self) -> str:
        """How messages name this request: the field and the value as the user wrote it."""
        shown = self.tactic.text if self.tactic else self.requested
        return f"{self.field} {shown!r}"


def moe_impl_request(
    backend_or_tactic: str | Tactic,
    *,
    eplb: bool = False,
    registry: Registry | None = None,
    field: str | None = None,
) -> Request:
    """Turn a backend literal or a tactic into a request (RQ1-RQ4).

    `field` names the config field the value came from (`moe_config.backend`, `moe_config.tactic`,
    `speculative_config.moe_backend`, ...): a `*backend` field holds a literal, any other a tactic.
    Without a field, an upper-case string (`AUTO`, `TORCH`, ...) is a literal and anything else a
    tactic, stored stripped and lowercased.
    """
    registry = registry or load_registry()
    if field is not None:
        is_tactic = not field.endswith("backend")
    else:
        is_tactic = isinstance(backend_or_tactic, Tactic) or not _looks_like_literal(backend_or_tactic)
    if is_tactic:
        return _tactic_request(backend_or_tactic, eplb, registry, field or "moe_config.tactic")
    return _literal_request(backend_or_tactic.strip(), eplb, registry, field or "moe_config.backend")


def _looks_like_literal(text: str) -> bool:
    stripped = text.strip()
    return any(c.isalpha() for c in stripped) and stripped == stripped.upper()


def _literal_request(literal: str, eplb: bool, registry: Registry, field: str) -> Request:
    if literal not in registry.literals:
        raise SelectionError(
            f"{field} {literal!r} is not a backend literal; literals: {', '.join(registry.literals)} "
            "(a tactic goes in the tactic field, in lower case) (RULES RQ1)"
        )
    usable = [i for i in registry.impls if i.capabilities.dynamic_eplb] if eplb else list(registry.impls)
    if literal == AUTO:
        if eplb and not usable:
            raise SelectionError(f"{field} 'AUTO' under dynamic EPLB: no implementation consumes EPLB plans (RULES RQ4)")
        return Request("auto", AUTO, field, tuple(usable), len(usable), eplb=eplb)
    own = [i for i in usable if i.backend == literal]
    if eplb and not own:
        raise SelectionError(
            f"{field} {literal!r} under dynamic EPLB: no {literal} implementation consumes EPLB plans; "
            f"backends that do: {', '.join(sorted({i.backend for i in usable})) or 'none'} (RULES RQ4)"
        )
    backend = registry.backend(literal)
    fallback: list[Impl] = []
    if not backend.fallback and not backend.never_degrades:
        fallback = [i for i in usable if i.backend == registry.fallback_backend]
    return Request("backend", literal, field, tuple(own + fallback), len(own), eplb=eplb)


def _tactic_request(text: str | Tactic, eplb: bool, registry: Registry, field: str) -> Request:
    tactic = text if isinstance(text, Tactic) else parse_tactic(text, registry, field)
    matches = matching_impls(tactic, registry)
    if eplb and not any(i.capabilities.dynamic_eplb for i in matches):
        raise TacticError(
            f"{field} {tactic.text!r} under dynamic EPLB names no implementation that consumes EPLB plans; "
            f"it matches {', '.join(str(i.id) for i in matches)} (RULES RQ4)"
        )
    return Request("tactic", tactic.canonical, field, matches, len(matches), tactic=tactic, eplb=eplb)


@dataclass(frozen=True)
class LayerReport:
    """How one layer kind resolved (LR5): what was asked, who won and why, who else could, who could not."""

    role: str                       # "target" | "excluded" | "draft"
    layers: tuple[int, ...]
    checkpoint_format: str
    format_source: str              # FN1: why the checkpoint holds this format
    run_format: str
    run_format_source: str          # FN2 or "checkpoint format"
    requested: str
    field: str
    winner: str
    winner_class: str
    backend: str
    selected_by: str                # pinned | preferred | fallback
    weights: str                    # the winner's registry `weights`, as text
    verification: str               # whether the winner has run on this SM ("runs on sm_100: unverified ...")
    alternatives: tuple[str, ...]
    rejections: tuple[Rejection, ...]
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "layers": list(self.layers),
            "checkpoint_format": self.checkpoint_format,
            "format_source": self.format_source,
            "run_format": self.run_format,
            "run_format_source": self.run_format_source,
            "requested": self.requested,
            "field": self.field,
            "winner": self.winner,
            "winner_class": self.winner_class,
            "backend": self.backend,
            "selected_by": self.selected_by,
            "weights": self.weights,
            "verification": self.verification,
            "alternatives": list(self.alternatives),
            "rejections": [{"impl": r.impl, "reason": r.reason.value, "detail": r.detail} for r in self.rejections],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class LayerOutcome:
    """The candidates' answers for one layer kind, before anything is decided from them."""

    winner: Impl | None
    selected_by: str | None
    eligible: tuple[Impl, ...]
    rejections: tuple[Rejection, ...]


def ask_candidates(
    request: Request,
    problem: Problem,
    deployment: Deployment,
    honored: frozenset[str] | None = None,
) -> LayerOutcome:
    """Ask every candidate of the layer's run format, in order; the first eligible one wins (LR1).

    Every candidate is asked so that the report lists alternatives. `honored` restricts the winner
    to a target's honored ids (TG4); an eligible candidate outside it is turned down NOT_HONORED.
    """
    eligible: list[tuple[int, Impl]] = []
    rejections: list[Rejection] = []
    for position, impl in enumerate(request.candidates):
        if impl.format != problem.format:
            continue  # other formats are not candidates for this layer at all
        rejection = eligibility(impl, problem, deployment)
        if rejection is None and honored is not None and str(impl.id) not in honored:
            rejection = Rejection(str(impl.id), Reason.NOT_HONORED, f"the target honors {Honored(honored).describe()}")
        if rejection is None:
            eligible.append((position, impl))
        else:
            rejections.append(rejection)
    winner, selected_by = None, None
    own = [impl for position, impl in eligible if position < request.own]
    rest = [impl for position, impl in eligible if position >= request.own]
    if own:
        winner, selected_by = own[0], PINNED if request.pinned else PREFERRED
    elif rest:
        winner, selected_by = rest[0], FALLBACK
    return LayerOutcome(winner, selected_by, tuple(impl for _, impl in eligible), tuple(rejections))


def no_winner_message(
    request: Request,
    outcome: LayerOutcome,
    what: str,
    *,
    fmt: str | None = None,
    registry: Registry | None = None,
) -> str:
    """LR3 for a pin (names the field that set the tactic), and the same trail for a preference.

    With `fmt` and `registry`, a request that holds no candidate of the layer's format says which
    registered implementations serve it: one may be registered but outside the request (e.g. TORCH, or
    AUTO under dynamic EPLB, for an nvfp4 layer that only VANILLA serves).
    """
    trail = "; ".join(r.describe() for r in outcome.rejections) or _not_in_request(request, fmt, registry)
    if request.pinned:
        return f"{request.asked} pins {what}, but no implementation it names can serve it: {trail} (RULES LR3)"
    return f"{request.asked} found no implementation for {what}: {trail} (RULES LR4)"


def _not_in_request(request: Request, fmt: str | None, registry: Registry | None) -> str:
    if fmt is None or registry is None:
        return "no implementation of this format is registered"
    serving = [i for i in registry.impls if i.format == fmt]
    if not serving:
        return f"no implementation of {fmt} is registered"
    which = " that consumes EPLB plans" if request.eplb else ""
    listed = ", ".join(f"{i.id} ({i.backend})" for i in serving)
    return f"the request holds no {fmt} implementation{which}; {fmt} is served by {listed}"

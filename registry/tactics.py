"""Tactics: dotted subsets of implementation ids that name implementations (RULES TA1-TA3).

A tactic is 1-4 segments in any order; each token finds its own field because the token sets of
the four fields are disjoint (ID2), and `*` is an explicit wildcard. It is stored stripped and
lowercased. Everything a tactic can be refused for is refused here, when it is parsed, before
anything loads (TA2).
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass

from registry.errors import TacticError
from registry.identity import FIELDS, ImplId
from registry.impls import Impl, Registry

WILDCARD = "*"


@dataclass(frozen=True)
class Tactic:
    """A parsed tactic: the text as stored, and the token it pins for each field (None = open)."""

    text: str
    provider: str | None = None
    technique: str | None = None
    kernel_name: str | None = None
    quant: str | None = None

    def pinned(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    @property
    def canonical(self) -> str:
        """Full width in field order, `*` for open fields: equal spellings give equal text."""
        return ".".join(getattr(self, f) or WILDCARD for f in FIELDS)

    @property
    def compact(self) -> str:
        """The pinned tokens in field order, without wildcards: the shortest equivalent spelling."""
        return ".".join(self.pinned().values())

    def matches(self, impl_id: ImplId) -> bool:
        return all(impl_id.segment(f) == token for f, token in self.pinned().items())

    def with_fields(self, **fields: str | None) -> "Tactic":
        """A tactic with some fields re-pinned or opened (used to suggest narrower/wider tactics)."""
        values = {f: getattr(self, f) for f in FIELDS} | fields
        text = ".".join(v for f in FIELDS if (v := values[f]) is not None)
        return Tactic(text=text, **values)


def parse_tactic(text: str, registry: Registry, field: str = "moe_config.tactic") -> Tactic:
    """Parse and check a tactic; `field` names where it was set, for the messages (TA1, TA2)."""
    stored = text.strip().lower()
    if not stored:
        raise TacticError(
            f"{field} is empty: name at least one segment of provider.technique.kernel_name.quant, "
            f"e.g. {_example(registry)!r} (RULES TA2)"
        )
    segments = stored.split(".")
    if len(segments) > len(FIELDS):
        raise TacticError(
            f"{field} {stored!r} has {len(segments)} segments; a tactic has at most 4, one for each field "
            "of provider.technique.kernel_name.quant (RULES TA2)"
        )
    for position, token in enumerate(segments, start=1):
        if not token:
            raise TacticError(
                f"{field} {stored!r} has an empty segment at position {position}: separate segments "
                "with single dots (RULES TA2)"
            )
    pinned: dict[str, str] = {}
    for token in segments:
        if token == WILDCARD:
            continue
        owner = registry.token_field.get(token)
        if owner is None:
            raise TacticError(f"{field} {stored!r}: unknown segment {token!r}; {_did_you_mean(token, registry)} (RULES TA2)")
        if owner in pinned:
            raise TacticError(
                f"{field} {stored!r}: {pinned[owner]!r} and {token!r} both name the {owner}; "
                "name each field at most once (RULES TA2)"
            )
        pinned[owner] = token
    if not pinned:
        raise TacticError(
            f"{field} {stored!r} constrains no field: name at least one segment besides '*' (RULES TA2)"
        )
    tactic = Tactic(text=stored, **pinned)
    if not matching_impls(tactic, registry):
        raise TacticError(f"{field} {stored!r} matches no registered implementation; {_nearby(tactic, registry)} (RULES TA2)")
    return tactic


def matching_impls(tactic: Tactic, registry: Registry) -> tuple[Impl, ...]:
    """The implementations a tactic names, in global priority order (RQ2)."""
    return tuple(i for i in registry.impls if tactic.matches(i.id))


def shortest_query(impl_id: ImplId | str, registry: Registry) -> str:
    """The tactic with the fewest segments that matches exactly this id (TA3).

    Ties go to the canonical field order (provider before technique before ...), then to the
    lexicographically smaller text.
    """
    target = ImplId.parse(str(impl_id))
    best: tuple | None = None
    for size in range(1, len(FIELDS) + 1):
        for fields in itertools.combinations(range(len(FIELDS)), size):
            tactic = Tactic(text="", **{FIELDS[i]: target.segment(FIELDS[i]) for i in fields})
            if [i.id for i in matching_impls(tactic, registry)] == [target]:
                key = (fields, tactic.compact)
                best = key if best is None or key < best else best
        if best is not None:
            return best[1]
    raise TacticError(f"{target} is not a registered implementation id")


def suggest(token: str, registry: Registry) -> list[str]:
    """The known tokens closest to a misspelled one (at most three)."""
    return difflib.get_close_matches(token, sorted(registry.token_field), n=3, cutoff=0.6)


def _did_you_mean(token: str, registry: Registry) -> str:
    close = suggest(token, registry)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    by_field = {f: sorted(t for t, owner in registry.token_field.items() if owner == f) for f in FIELDS}
    return "known segments: " + "; ".join(f"{f} {', '.join(tokens)}" for f, tokens in by_field.items())


def _nearby(tactic: Tactic, registry: Registry) -> str:
    """What the tactic would match with one segment dropped: the nearest thing that exists."""
    options = []
    for field, token in tactic.pinned().items():
        wider = tactic.with_fields(**{field: None})
        if wider.pinned():
            found = matching_impls(wider, registry)
            if found:
                options.append(f"without {token!r}: {', '.join(str(i.id) for i in found)}")
    if not options:
        return "see `python -m codegen catalog` for every id and its shortest tactic"
    return "; ".join(options)


def _example(registry: Registry) -> str:
    return shortest_query(registry.impls[0].id, registry)

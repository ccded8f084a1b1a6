"""The unit model-level resolution works on: a layer kind (`Group`), the task of resolving it (`LayerTask`), and what resolving collects besides reports (`Findings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract import ROLE_NAMES, ROLES
from registry.model import MoeSite
from registry.resolve import Request


@dataclass(frozen=True)
class Group:
    """Layers that resolve together: same role and checkpoint format."""

    role: str                     # one of contract.ROLES
    checkpoint_format: str
    sources: tuple[str, ...]
    layers: tuple[int, ...]

    @property
    def source(self) -> str:
        return "; ".join(self.sources)

    def describe(self) -> str:
        return f"{ROLE_NAMES[self.role]} layers {span(self.layers)}"


@dataclass(frozen=True)
class LayerTask:
    """One layer kind to resolve: its layers, the request that selects them, the run format they run as
    (FN2-FN4) and why, and a warning the choice of request carries (FN5)."""

    group: Group
    request: Request
    run_format: str
    run_format_source: str
    warning: str | None = None

    def where(self, sm: int) -> str:
        """How messages name the task: `routed layers 1-60 (format bf16 on sm_90)`."""
        return f"{self.group.describe()} (format {self.run_format} on sm_{sm})"


@dataclass
class Findings:
    """What resolving a model says besides its reports: notes, warnings, and the target's refusals (TG3, TG4)."""

    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def span(layers: tuple[int, ...]) -> str:
    """`1-92`, or `3, 7, 11` when not contiguous."""
    if len(layers) > 1 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(str(i) for i in layers)


def groups(sites: tuple[MoeSite, ...], role: str) -> list[Group]:
    """The layer kinds of one side: a target's sites split into routed and excluded (bf16) layers, by format."""
    keyed: dict[tuple[str, str], list[MoeSite]] = {}
    for site in sites:
        kind = "excluded" if (role == "target" and site.format.excluded) else role
        keyed.setdefault((kind, site.format.format), []).append(site)
    found = [
        Group(kind, fmt, tuple(sorted({s.format.source for s in members})), tuple(sorted(s.layer for s in members)))
        for (kind, fmt), members in keyed.items()
    ]
    return sorted(found, key=lambda g: (ROLES.index(g.role), g.layers[0]))

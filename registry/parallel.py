"""Parallel layout names: `tp<N>`, `tp<N>_moetp<X>ep<Y>`, `dep<N>`, or a model's declared profile.

A layout is part of a target's identity because it changes weight shapes (RULES TG1). The runtime
receives the numbers (`runtime.parallel.Layout`); this module owns the names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from registry.errors import SelectionError

_TP = re.compile(r"^tp([1-9][0-9]*)$")
_TP_MOE = re.compile(r"^tp([1-9][0-9]*)_moetp([1-9][0-9]*)ep([1-9][0-9]*)$")
_DEP = re.compile(r"^dep([1-9][0-9]*)$")
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Layout:
    """Attention tensor parallel `tp`, MoE tensor parallel `moe_tp` x expert parallel `ep`, attention data parallel `dp`."""

    tp: int = 1
    moe_tp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.tp, self.moe_tp, self.ep, self.dp)


def layout_grammar(name: str) -> bool:
    """Whether `name` is spelled as a layout (tp<N>, tp<N>_moetp<X>ep<Y>, dep<N>): no profile may be,
    or one name would stand for two layouts depending on the model."""
    return any(p.match(name) for p in (_TP, _TP_MOE, _DEP))


def parse_layout(name: str, profiles: dict[str, Layout] | None = None) -> Layout:
    """The layout a parallel name stands for; `profiles` are the model's declared names (e.g. low_latency)."""
    if profiles and name in profiles:
        return profiles[name]
    if m := _TP.match(name):
        n = int(m[1])
        return Layout(tp=n, moe_tp=n, ep=1)
    if m := _TP_MOE.match(name):
        n, x, y = (int(g) for g in m.groups())
        if x * y != n:
            raise SelectionError(
                f"parallel layout {name!r}: moetp{x} x ep{y} = {x * y} ranks, but tp{n} has {n}; "
                "the MoE split must cover the same ranks as attention"
            )
        return Layout(tp=n, moe_tp=x, ep=y)
    if m := _DEP.match(name):
        n = int(m[1])
        return Layout(tp=1, moe_tp=1, ep=n, dp=n)
    known = ", ".join(sorted(profiles)) if profiles else "none declared"
    raise SelectionError(
        f"parallel layout {name!r} is not tp<N>, tp<N>_moetp<X>ep<Y>, dep<N> or a declared profile "
        f"(this model's profiles: {known})"
    )

"""Eligibility gates: pure functions of the registry's data, a layer's problem and the deployment (RULES LR1, LR2).

Nothing here probes the machine: the SM is an input, so `explain --sm 100` on a laptop answers what
an SM100 GPU would run. A fact the caller does not know (None) makes its gate abstain: unknown is
not false.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from contract import MoeShape
from registry.impls import Impl


class Reason(str, Enum):
    """Why a candidate was turned down: a closed set, so tests and tools can match on it (LR2)."""

    QUANT_UNSUPPORTED = "QUANT_UNSUPPORTED"
    SM_UNSUPPORTED = "SM_UNSUPPORTED"
    # Named by RULES LR2; no gate emits it yet (the registry declares no activation dtype data).
    DTYPE_UNSUPPORTED = "DTYPE_UNSUPPORTED"
    ACTIVATION_UNSUPPORTED = "ACTIVATION_UNSUPPORTED"
    BIAS_UNSUPPORTED = "BIAS_UNSUPPORTED"
    SHAPE_UNALIGNED = "SHAPE_UNALIGNED"
    TOPOLOGY_UNSUPPORTED = "TOPOLOGY_UNSUPPORTED"
    EPLB_UNSUPPORTED = "EPLB_UNSUPPORTED"
    NOT_HONORED = "NOT_HONORED"


@dataclass(frozen=True)
class Problem:
    """One MoE layer kind as an implementation sees it; None = not known (the gate abstains)."""

    format: str
    activation: str | None = None
    expert_bias: bool | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None

    @classmethod
    def of(cls, fmt: str, shape: MoeShape | None) -> Problem:
        """A layer kind of this run format and shape; without a shape only the format is known."""
        if shape is None:
            return cls(format=fmt)
        return cls(format=fmt, activation=shape.activation, expert_bias=shape.expert_bias, hidden_size=shape.hidden_size,
                   intermediate_size=shape.intermediate_size, num_experts=shape.num_experts)


@dataclass(frozen=True)
class Deployment:
    """Where the layer runs: the target SM and the MoE parallel split."""

    sm: int
    moe_tp: int = 1
    ep: int = 1
    eplb: bool = False


@dataclass(frozen=True)
class Rejection:
    """A candidate turned down: its id, a reason from the closed set, and the value that failed."""

    impl: str
    reason: Reason
    detail: str

    def __post_init__(self):
        if not self.detail:
            raise ValueError("a rejection needs a detail naming the value that failed (RULES LR2)")

    def describe(self) -> str:
        return f"{self.impl}: {self.reason.value} ({self.detail})"


def eligibility(impl: Impl, problem: Problem, deployment: Deployment) -> Rejection | None:
    """None when the implementation can serve the layer, else the first gate that rejects it.

    The format gate runs first, so a format this implementation does not serve is never described
    in terms of an SM or shape it would also fail.
    """
    for gate in _GATES:
        detail = gate(impl, problem, deployment)
        if detail is not None:
            return Rejection(str(impl.id), detail[0], detail[1])
    return None


def _quant(impl, p, d):
    if p.format != impl.format:
        return Reason.QUANT_UNSUPPORTED, f"serves {impl.format}, the layer runs {p.format}"


def _sm(impl, p, d):
    if not impl.runs_on(d.sm):
        sms = ", ".join(f"sm_{s}" for s in sorted(impl.sms)) or "no GPU"
        return Reason.SM_UNSUPPORTED, f"sm_{d.sm} is not among {sms}"


def _activation(impl, p, d):
    if p.activation is not None and p.activation not in impl.capabilities.activations:
        return Reason.ACTIVATION_UNSUPPORTED, f"{p.activation} is not among {', '.join(sorted(impl.capabilities.activations))}"


def _bias(impl, p, d):
    if p.expert_bias and not impl.capabilities.expert_bias:
        return Reason.BIAS_UNSUPPORTED, "the experts have biases"


def _topology(impl, p, d):
    caps = impl.capabilities
    if d.ep > 1 and not caps.expert_parallel:
        return Reason.TOPOLOGY_UNSUPPORTED, f"expert parallel ep{d.ep} is not supported"
    if d.moe_tp > 1 and not caps.moe_tensor_parallel:
        return Reason.TOPOLOGY_UNSUPPORTED, f"MoE tensor parallel moetp{d.moe_tp} is not supported"
    if p.num_experts is not None and p.num_experts % d.ep:
        return Reason.TOPOLOGY_UNSUPPORTED, f"{p.num_experts} experts do not split over ep{d.ep}"
    if p.intermediate_size is not None and p.intermediate_size % d.moe_tp:
        return Reason.TOPOLOGY_UNSUPPORTED, f"intermediate size {p.intermediate_size} does not split over moetp{d.moe_tp}"


def _shape(impl, p, d):
    c = impl.constraints
    if p.hidden_size is not None and p.hidden_size % c.hidden_multiple:
        return Reason.SHAPE_UNALIGNED, f"hidden size {p.hidden_size} is not a multiple of {c.hidden_multiple}"
    if p.intermediate_size is not None:
        shard = p.intermediate_size // d.moe_tp
        if shard % c.intermediate_multiple:
            return (
                Reason.SHAPE_UNALIGNED,
                f"intermediate shard {shard} (moetp{d.moe_tp}) is not a multiple of {c.intermediate_multiple}",
            )


def _eplb(impl, p, d):
    if d.eplb and not impl.capabilities.dynamic_eplb:
        return Reason.EPLB_UNSUPPORTED, "does not consume per-layer dynamic EPLB plans"


_GATES = (_quant, _sm, _activation, _bias, _topology, _shape, _eplb)

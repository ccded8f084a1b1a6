"""The few value types every room shares (run formats, activations, layer roles, the parallel layout, the MoE layer shape, a target's honored ids), in the standard library only so that registry, codegen, runtime and generated builds all import this one copy."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The run formats an implementation may serve (the quant segment of its id), in the order of
# docs/runtime.md's table; the three MXFP4 ones read the same checkpoint tensors. Closed sets: a new
# one is a deliberate change to the runtime and the registry at once.
RUN_FORMATS = ("bf16", "fp8_block_scales", "w4a16_mxfp4", "w4a8_mxfp4_fp8", "w4a8_mxfp4_mxfp8", "w4a16_nvfp4", "nvfp4")
MXFP4_RUN_FORMATS = ("w4a16_mxfp4", "w4a8_mxfp4_fp8", "w4a8_mxfp4_mxfp8")

# Expert activations (SiLU-GLU, gpt-oss clamped SwiGLU, non-gated relu²); the gated ones have a gate projection.
ACTIVATIONS = ("silu_glu", "swiglu_oai", "relu2")
GATED = frozenset({"silu_glu", "swiglu_oai"})

# The roles of a model's MoE layer kinds, in report order, and how messages and `explain` name them.
ROLES = ("target", "excluded", "draft")
ROLE_NAMES = {"target": "routed", "excluded": "excluded", "draft": "draft"}


class ContractError(ValueError):
    """A value that breaks one of these types' rules; the message names the value and what is allowed."""


# -- the parallel layout ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Attention tensor parallel `tp` x attention data parallel `dp` ranks; MoE tensor parallel `moe_tp` x
    expert parallel `ep` over the same world.

    Rank numbering (docs/runtime.md): attention rank `r` is `tp_rank = r % tp` in replica `dp_rank = r // tp`,
    so the ranks of one TP group are consecutive; MoE: `ep_rank = r // moe_tp`, `moe_tp_rank = r % moe_tp`.
    """

    tp: int = 1
    moe_tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "moe_tp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ContractError(f"Layout.{name} must be a positive int, got {value!r}")
        if self.moe_tp * self.ep != self.world:
            raise ContractError(
                f"Layout(tp={self.tp}, moe_tp={self.moe_tp}, ep={self.ep}, dp={self.dp}): moe_tp * ep = "
                f"{self.moe_tp * self.ep} must equal world = tp * dp = {self.world}"
            )

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.tp, self.moe_tp, self.ep, self.dp)

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ContractError(f"rank {rank} is outside this layout's world of {self.world}")
        return rank

    def tp_rank(self, rank: int) -> int:
        return self._check(rank) % self.tp

    def dp_rank(self, rank: int) -> int:
        return self._check(rank) // self.tp

    def ep_rank(self, rank: int) -> int:
        return self._check(rank) // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return self._check(rank) % self.moe_tp

    def tp_group_ranks(self, dp_rank: int) -> tuple[int, ...]:
        """The ranks that share one attention replica (one TP group)."""
        return tuple(dp_rank * self.tp + i for i in range(self.tp))

    def dp_group_ranks(self, tp_rank: int) -> tuple[int, ...]:
        """The ranks holding the same attention shard in different replicas (one DP group)."""
        return tuple(d * self.tp + tp_rank for d in range(self.dp))


# A parallel name (a layout token or a declared profile) is part of a target's name (RULES TG1).
PARALLEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_TP = re.compile(r"^tp([1-9][0-9]*)$")
_TP_MOE = re.compile(r"^tp([1-9][0-9]*)_moetp([1-9][0-9]*)ep([1-9][0-9]*)$")
_DEP = re.compile(r"^dep([1-9][0-9]*)$")


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
            raise ContractError(
                f"parallel layout {name!r}: moetp{x} x ep{y} = {x * y} ranks, but tp{n} has {n}; "
                "the MoE split must cover the same ranks as attention"
            )
        return Layout(tp=n, moe_tp=x, ep=y)
    if m := _DEP.match(name):
        n = int(m[1])
        return Layout(tp=1, moe_tp=1, ep=n, dp=n)
    known = ", ".join(sorted(profiles)) if profiles else "none declared"
    raise ContractError(
        f"parallel layout {name!r} is not tp<N>, tp<N>_moetp<X>ep<Y>, dep<N> or a declared profile "
        f"(this model's profiles: {known})"
    )


# -- the MoE layer shape ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeShape:
    """One MoE layer as an experts implementation sees it: the registry checks eligibility against it and
    the runtime builds the layer from it."""

    hidden_size: int
    intermediate_size: int        # per expert, unsharded
    num_experts: int              # global routed experts
    top_k: int
    activation: str               # one of ACTIVATIONS
    expert_bias: bool = False     # per-expert biases on both GEMMs (gpt-oss)
    swiglu_alpha: float = 1.702   # swiglu_oai only
    swiglu_limit: float = 7.0     # swiglu_oai only

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ContractError(f"MoeShape.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ContractError(f"MoeShape.top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.activation not in ACTIVATIONS:
            raise ContractError(f"unknown expert activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def projections(self) -> tuple[str, ...]:
        return ("gate", "up", "down") if self.gated else ("up", "down")


# -- a target's honored implementation ids (RULES TG2-TG4) --------------------------------------------

ANY = "*"


@dataclass(frozen=True)
class Honored:
    """What a target's `moe_impls_honored` declares, one of three states: a list of ids (`ids`), any id
    (`wildcard`, spelled "*"), or nothing (left out: the target honors no tactic, TG2)."""

    ids: frozenset[str] | None = None
    wildcard: bool = False

    def __post_init__(self):
        if self.wildcard and self.ids is not None:
            raise ContractError("Honored is either a list of ids or any id (\"*\"), not both")

    @classmethod
    def parse(cls, value) -> Honored:
        """From a declaration or a generated literal: a list (or tuple) of ids, "*", or None (left out)."""
        if value is None:
            return cls()
        if value == ANY:
            return cls(wildcard=True)
        if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
            return cls(frozenset(value))
        raise ContractError(f'{value!r} is not a list of implementation ids, "*" (any) or left out (honors none) (RULES TG2)')

    @property
    def declared(self) -> bool:
        """False when the target leaves the field out (it then honors no tactic, TG2)."""
        return self.wildcard or self.ids is not None

    def literal(self) -> tuple[str, ...] | str | None:
        """As a plan, the build index and a generated build write it: the sorted ids, "*", or None."""
        if self.wildcard:
            return ANY
        return None if self.ids is None else tuple(sorted(self.ids))

    @property
    def restricts(self) -> frozenset[str] | None:
        """TG4: a declared list restricts which implementation may win a layer; any, or nothing, does not."""
        return None if self.wildcard else self.ids

    def allows(self, impl_id: str) -> bool:
        """TG3: whether a tactic that may resolve to `impl_id` stays honored."""
        return self.wildcard or (self.ids is not None and impl_id in self.ids)

    def describe(self) -> str:
        """How refusals name it: "any implementation", "only a, b", "no implementation", or no tactic."""
        if self.wildcard:
            return "any implementation"
        if self.ids is None:
            return "no tactic (it declares no honored ids)"
        return "only " + ", ".join(sorted(self.ids)) if self.ids else "no implementation"

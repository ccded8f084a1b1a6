"""The parallel layout of a build as numbers (`Layout`) and the collectives its ops call by group name.

Ops are built from plain integers (`tp_rank`, `tp_size`, ...) that a generated build inlines, and at run
time they name the group they reduce over ("tp", "dp", "world") instead of holding a process group: the
same op class then serves every layout, it can be constructed before torch.distributed is up (or on the
meta device), and a one-rank build never touches torch.distributed at all, because every collective
returns its input unchanged when its group has one rank.

Rank numbering (docs/runtime.md): `world = tp * dp` and `moe_tp * ep == world`. Attention: rank `r` is
`tp_rank = r % tp` in data-parallel replica `dp_rank = r // tp`, so the ranks of one TP group are
consecutive. MoE: `ep_rank = r // moe_tp`, `moe_tp_rank = r % moe_tp` over the whole world.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

TP = "tp"
DP = "dp"
WORLD = "world"


@dataclass(frozen=True)
class Layout:
    """Attention TP x attention DP ranks; MoE TP x EP over the same world."""

    tp: int = 1
    moe_tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "moe_tp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")
        if self.moe_tp * self.ep != self.world:
            raise ValueError(
                f"Layout(tp={self.tp}, moe_tp={self.moe_tp}, ep={self.ep}, dp={self.dp}): moe_tp * ep = "
                f"{self.moe_tp * self.ep} must equal world = tp * dp = {self.world}"
            )

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside this layout's world of {self.world}")
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


# Process groups by name, filled by `init_process_groups`. "world" is the default group.
_GROUPS: dict[str, dist.ProcessGroup | None] = {}


def distributed_world() -> int:
    """World size of torch.distributed, 1 when it is not available or not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def init_process_groups(layout: Layout) -> None:
    """Create and register this rank's "tp" and "dp" groups (every rank must call it, in the same order)."""
    world = distributed_world()
    if world != layout.world:
        raise ValueError(f"torch.distributed has {world} ranks but the layout {layout} needs {layout.world}")
    _GROUPS.clear()
    if world == 1:
        return
    rank = dist.get_rank()
    # new_group is collective over the default group: every rank creates every group, keeps its own.
    for d in range(layout.dp):
        group = dist.new_group(list(layout.tp_group_ranks(d)))
        if layout.dp_rank(rank) == d:
            _GROUPS[TP] = group
    for t in range(layout.tp):
        group = dist.new_group(list(layout.dp_group_ranks(t)))
        if layout.tp_rank(rank) == t:
            _GROUPS[DP] = group
    _GROUPS[WORLD] = None


def _resolve(group) -> tuple[int, dist.ProcessGroup | None]:
    """(size, process group) for a group name or object; size 1 when torch.distributed is not in use."""
    if distributed_world() == 1:
        return 1, None
    if isinstance(group, str):
        if group == WORLD:
            return dist.get_world_size(), None
        if group not in _GROUPS:
            raise RuntimeError(f"process group {group!r} is not set up; call runtime.parallel.init_process_groups")
        group = _GROUPS[group]
    return dist.get_world_size(group), group


def group_size(group=TP) -> int:
    return _resolve(group)[0]


def all_reduce(x: torch.Tensor, group=TP) -> torch.Tensor:
    """Sum over the group; the input itself on one rank."""
    size, pg = _resolve(group)
    if size == 1:
        return x
    dist.all_reduce(x, group=pg)
    return x


def all_gather(x: torch.Tensor, dim: int = -1, group=TP) -> torch.Tensor:
    """Concatenate the group's equally shaped tensors along `dim`, in rank order."""
    size, pg = _resolve(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=TP) -> torch.Tensor:
    """Sum over the group, then keep this rank's chunk along `dim` (the size must divide evenly)."""
    size, pg = _resolve(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split over {size} ranks")
    if dist.get_backend(pg) == "gloo":
        # gloo has no reduce-scatter; the CPU path only runs in tests, where the extra traffic is free.
        dist.all_reduce(x, group=pg)
        return x.chunk(size, dim=dim)[dist.get_rank(pg)].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=pg)
    return out.movedim(0, dim)


def group_rank(group=TP) -> int:
    size, pg = _resolve(group)
    return 0 if size == 1 else dist.get_rank(pg)

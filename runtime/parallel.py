"""The parallel layout of a build as numbers (`Layout`), the process groups it runs on, and the collectives its ops call by group name.

Ops are built from plain integers (`tp_rank`, `tp_size`, ...) that a generated build inlines, and at run
time they name the group they reduce over ("tp", "dp", "world") instead of holding a process group: the
same op class then serves every layout, it can be constructed before torch.distributed is up (or on the
meta device), and a one-rank build never touches torch.distributed at all, because every collective
returns its input unchanged when its group has one rank.

Rank numbering (docs/runtime.md): `world = tp * dp` and `moe_tp * ep == world`. Attention: rank `r` is
`tp_rank = r % tp` in data-parallel replica `dp_rank = r // tp`, so the ranks of one TP group are
consecutive. MoE: `ep_rank = r // moe_tp`, `moe_tp_rank = r % moe_tp` over the whole world.

`Layout` (the numbers and the rank helpers) is the shared one from `contract`. A generated build calls
`attach_layout` first thing in its constructor: it refuses a torch.distributed world that does not
fit the layout (naming both) before any collective runs, creates this layout's
groups once per process, and makes every forward re-check the world and re-select the layout's groups,
so one process may hold builds of several layouts of the same world (the tests run tp2 and dep2 builds
side by side) without one build reducing over the other's groups.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os

import torch
import torch.distributed as dist

from contract import Layout

TP = "tp"
DP = "dp"
WORLD = "world"

# Bounded waits: process-group creation and every collective give up after this many seconds, so a
# rank whose peer died or hangs fails with an error instead of waiting forever. Generous by default
# because ranks reach their first collective only after loading their shard of a checkpoint, and
# loads of different ranks may finish minutes apart; `set_timeout` (the launcher's --timeout) or
# MOEGEN_DIST_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 300.0
_timeout_s: float | None = None


class LayoutError(ValueError):
    """A build's layout does not fit the torch.distributed world it runs in; the message names both."""


class CapacityError(ValueError):
    """More tokens than a fixed-capacity MoE exchange holds, or ranks that disagree on its capacity."""


# -- timeouts -------------------------------------------------------------------------------------------


def set_timeout(seconds: float) -> None:
    """The bound on process-group creation and collectives for groups created from now on."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"the collective timeout must be positive, got {seconds}")
    _timeout_s = float(seconds)


def timeout_seconds(explicit: float | None = None) -> float:
    """The bound a run uses: `explicit` (the launcher's --timeout), else MOEGEN_DIST_TIMEOUT_S, else
    DEFAULT_TIMEOUT_S; a value that is not a positive number of seconds is refused, naming it."""
    if explicit is not None:
        where, value = "--timeout", explicit
    else:
        where, value = "MOEGEN_DIST_TIMEOUT_S", os.environ.get("MOEGEN_DIST_TIMEOUT_S")
        if value is None:
            return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{where} must be a positive number of seconds, got {value!r}")
    return seconds


def timeout() -> datetime.timedelta:
    """The configured bound: `set_timeout`, else MOEGEN_DIST_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    return datetime.timedelta(seconds=_timeout_s if _timeout_s is not None else timeout_seconds())


# -- the world and its groups --------------------------------------------------------------------------

# A group of one rank needs no process group and no collective: marked, never created.
_ONE = "one rank"
# Groups per layout, created once per process (new_group is collective and NCCL communicators are a
# resource); valid only for the default group they were created under, remembered in _owner.
_CACHE: dict[Layout, dict[str, object]] = {}
_owner: object = None
# The layout whose groups "tp"/"dp" name right now.
_active: Layout | None = None


def distributed_world() -> int:
    """World size of torch.distributed, 1 when it is not available or not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def ranks(n: int) -> str:
    """`1 rank`, `2 ranks`: how every message counts ranks."""
    return f"{n} rank{'s' if n != 1 else ''}"


def check_world(build: str, parallel: str, layout: Layout, rank: int) -> None:
    """Refuse a torch.distributed world that does not fit `layout` (or a rank that is not this process's).

    Without torch.distributed nothing is checked here: constructing one rank's shard (on the meta device,
    to inspect or test loading) needs no world; running it does, and `use_layout` checks that.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world != layout.world:
        raise LayoutError(f"{build} needs {ranks(layout.world)} ({parallel}); torch.distributed has {world}")
    here = dist.get_rank()
    if here != rank:
        raise LayoutError(
            f"{build} was built for rank {rank}, but this process is rank {here} of torch.distributed; "
            f"build it with rank=torch.distributed.get_rank()"
        )


def _new_groups(layout: Layout) -> dict[str, object]:
    """This rank's "tp" and "dp" groups; every rank creates every multi-rank group, in the same order."""
    groups: dict[str, object] = {WORLD: None}
    rank = dist.get_rank()
    for name, size, count, members, mine in (
        (TP, layout.tp, layout.dp, layout.tp_group_ranks, layout.dp_rank(rank)),
        (DP, layout.dp, layout.tp, layout.dp_group_ranks, layout.tp_rank(rank)),
    ):
        if size == 1:
            groups[name] = _ONE
        elif size == layout.world:
            groups[name] = None  # the default group: nothing to create
        else:
            for i in range(count):
                group = dist.new_group(list(members(i)), timeout=timeout())
                if i == mine:
                    groups[name] = group
    return groups


def init_process_groups(layout: Layout) -> None:
    """Create this rank's "tp" and "dp" groups of `layout` (once per process) and make them the active ones.

    Every rank must call it for the same layouts in the same order (group creation is collective).
    """
    global _owner, _active
    world = distributed_world()
    if world != layout.world:
        raise LayoutError(f"torch.distributed has {world} ranks but the layout {layout} needs {layout.world}")
    if world > 1:
        if _owner is not dist.group.WORLD:
            _CACHE.clear()
            _owner = dist.group.WORLD
        if layout not in _CACHE:
            _CACHE[layout] = _new_groups(layout)
    _active = layout


def use_layout(build: str, parallel: str, layout: Layout) -> None:
    """Before running a build: its world must be up and fit it; its groups become the active ones."""
    global _active
    if layout.world > 1 and distributed_world() == 1:
        raise LayoutError(
            f"{build} needs {ranks(layout.world)} ({parallel}); torch.distributed is not initialised "
            f"(run it through python -m generated.run --nproc {layout.world}, or torchrun)"
        )
    world = distributed_world()
    if world != layout.world:
        raise LayoutError(f"{build} needs {ranks(layout.world)} ({parallel}); torch.distributed has {world}")
    if world > 1 and (_owner is not dist.group.WORLD or layout not in _CACHE):
        init_process_groups(layout)  # a build constructed before torch.distributed came up
    _active = layout


class _UseLayout:
    """Forward pre-hook of a build: `use_layout` before every forward (a plain object so builds deep-copy)."""

    def __init__(self, build: str, parallel: str, layout: Layout) -> None:
        self.build, self.parallel, self.layout = build, parallel, layout

    def __call__(self, module, args) -> None:
        use_layout(self.build, self.parallel, self.layout)


def attach_layout(model: torch.nn.Module, build: str, parallel: str, layout: Layout, rank: int) -> None:
    """What a build's constructor does first: check the world, set up its groups, re-check at each forward.

    `build` and `parallel` only name things in messages (e.g. `tiny_qwen3_moe_bf16__sm_90__tp2`, `tp2`).
    """
    check_world(build, parallel, layout, rank)
    if distributed_world() > 1:
        init_process_groups(layout)
    model.register_forward_pre_hook(_UseLayout(build, parallel, layout))


# -- collectives ---------------------------------------------------------------------------------------


def _resolve(group) -> tuple[int, dist.ProcessGroup | None]:
    """(size, process group) for a group name or object; size 1 when torch.distributed is not in use."""
    if distributed_world() == 1:
        return 1, None
    if isinstance(group, str):
        if group == WORLD:
            return dist.get_world_size(), None
        groups = _CACHE.get(_active) if _owner is dist.group.WORLD else None
        if groups is None or group not in groups:
            raise RuntimeError(f"process group {group!r} is not set up; call runtime.parallel.init_process_groups")
        group = groups[group]
        if group is _ONE:
            return 1, None
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


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=WORLD) -> torch.Tensor:
    """Rows `x[sum(send_counts[:r]) : ...]` go to rank r; returns the rows received, in rank order."""
    size, pg = _resolve(group)
    if size == 1:
        return x
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=pg)
    return out


def exchange_counts(send_counts: torch.Tensor, group=WORLD) -> list[int]:
    """Each rank's row counts for this rank, given this rank's counts for each of them (a host sync)."""
    size, pg = _resolve(group)
    if size == 1:
        return send_counts.tolist()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=pg)
    return recv.tolist()


def group_rank(group=TP) -> int:
    size, pg = _resolve(group)
    return 0 if size == 1 else dist.get_rank(pg)


# -- fixed-capacity token exchange (a captured decode step) --------------------------------------------

# Tokens per rank every MoE exchange of a data-parallel layout holds while a decode step runs (None: the
# exchange sizes itself from counts it reads back, as prefill does). Read when the step is traced (eager,
# or once while a CUDA graph captures it), so a replay has fixed shapes and no host sync.
_capacity: int | None = None


@contextlib.contextmanager
def token_capacity(tokens: int):
    """Inside: every rank holds at most `tokens` tokens per forward (its decode bucket), and the MoE
    exchange of a data-parallel layout moves fixed blocks of that many rows per rank."""
    global _capacity
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"a token capacity is a positive int, got {tokens!r}")
    outer, _capacity = _capacity, tokens
    try:
        yield
    finally:
        _capacity = outer


def capacity() -> int | None:
    """The token capacity `token_capacity` set, or None outside it."""
    return _capacity


def check_same_tokens(tokens: int, build: str, device) -> None:
    """Refuse, on every rank alike, ranks whose decode buckets differ: the fixed-capacity exchange needs
    one block size on every rank. A host sync over the world: call it outside any CUDA graph capture."""
    size, pg = _resolve(WORLD)
    if size == 1:
        return
    mine = torch.tensor([tokens], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=pg)
    counts = torch.cat(every).tolist()
    if len(set(counts)) > 1:
        raise CapacityError(
            f"{build}: the ranks decode batch buckets of {', '.join(map(str, counts))} rows (in rank order); "
            f"the MoE exchange moves fixed blocks of one bucket's rows per rank, so every data-parallel "
            f"replica must decode the same bucket: give each replica the same number of rows")

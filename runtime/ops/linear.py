"""Linear layers split for tensor parallelism: column-split (output features) and row-split (input features).

Attention projections, dense MLPs, shared experts and the LM head are all one of these two shapes, so
the splitting rule and the `param.shard` metadata the loader reads live here once. A shard is tagged
`param.shard = (dim, rank, size)`: "this tensor is chunk `rank` of `size` equal chunks of the checkpoint
tensor along `dim`". With `size == 1` nothing is tagged and the layer is a plain `nn.Linear` equivalent.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import parallel


def new_param(*shape: int, dtype: torch.dtype | None, shard: tuple[int, int, int] | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights always come from a checkpoint), tagged when it is a shard."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    if shard is not None and shard[2] > 1:
        param.shard = shard
    return param


def split(total: int, size: int, what: str) -> int:
    """`total / size`, refusing a split that is not exact (a ragged shard is never what a layout meant)."""
    if total % size:
        raise ValueError(f"{what} = {total} does not split evenly over {size} tensor-parallel ranks")
    return total // size


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with the output features split: each rank computes its slice, no communication.

    `shard` overrides the default chunking `(0, tp_rank, tp_size)`; GQA uses it to replicate key/value
    heads when there are fewer of them than ranks.
    """

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        shard: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank, size = shard if shard is not None else (tp_rank, tp_size)
        local = split(out_features, size, "out_features")
        self.weight = new_param(local, in_features, dtype=dtype, shard=(0, rank, size))
        self.bias = new_param(local, dtype=dtype, shard=(0, rank, size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with the input features split: partial sums, summed over the TP group.

    `reduce=False` leaves the partial sum to the caller (the MoE block reduces routed and shared
    outputs in one collective). The bias is added once, after the reduction, never per rank.
    """

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        local = split(in_features, tp_size, "in_features")
        self.reduce = reduce and tp_size > 1
        if bias and tp_size > 1 and not reduce:
            raise ValueError("a row-split linear with a bias must reduce, or the bias would be summed tp_size times")
        self.weight = new_param(out_features, local, dtype=dtype, shard=(1, tp_rank, tp_size))
        self.bias = new_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = parallel.all_reduce(y, parallel.TP)
        if self.bias is not None:
            y = y + self.bias
        return y

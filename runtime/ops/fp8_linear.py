"""Linear layers whose weight stays as a DeepSeek-style FP8 checkpoint stores it: E4M3 codes plus an fp32 scale per 128x128 block.

Drop-ins for runtime/ops/linear.py's column- and row-split linears where the checkpoint is FP8-block:
the same constructor arguments and split rule, the checkpoint's names (`weight` float8_e4m3fn
[out, in], `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)], a dequant multiplier despite its
name), so the loader reads both as they are stored. A tensor-parallel shard must hold whole blocks.

Forward, DeepSeek's recipe: activations quantized per token per 128 channels (E4M3, fp32 scale), each
128-wide K-block's product scaled by both scales, fp32 accumulation, output in the activation dtype.
On CUDA (sm_89+, `in` a multiple of 16) that is the Triton kernel runtime/kernels/triton_fp8_linear.py.
Elsewhere it is the same recipe in torch: the activations quantized and dequantized by
runtime/formats/fp8 (the kernel's quantization, bit for bit), times the block-dequantized weight in
fp32. That matches the kernel up to fp32 summation order, where dequantizing the weight alone would
differ from it by the activation rounding (one E4M3 step, 2^-4 relative).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import parallel
from runtime.formats import fp8
from runtime.ops.linear import new_param, split

BLOCK = fp8.WEIGHT_BLOCK


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _block_split(total: int, size: int, what: str) -> int:
    local = split(total, size, what)
    if size > 1 and local % BLOCK:
        raise ValueError(f"{what} = {total} over {size} tensor-parallel ranks gives {local} per rank, which cuts "
                         f"the checkpoint's {BLOCK}x{BLOCK} FP8 weight blocks; use a tensor-parallel size that "
                         f"leaves a multiple of {BLOCK} per rank")
    return local


def _kernel_runs(x: torch.Tensor, in_features: int) -> bool:
    return (x.is_cuda and in_features % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [..., in] @ dequant(weight, scale)^T` with x quantized per token per 128 channels, in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    if _kernel_runs(x, k):
        from runtime.kernels.triton_fp8_linear import fp8_block_linear as kernel

        return kernel(x.reshape(-1, k).contiguous(), weight, scale).view(*lead, weight.shape[0])
    w = fp8.dequantize_weight_blocks(weight, scale, torch.float32)
    return F.linear(fp8.qdq_act_groups(x), w).to(x.dtype)


class _Fp8BlockLinear(nn.Module):
    def _params(self, out_local: int, in_local: int, shard: tuple[int, int, int] | None) -> None:
        self.weight = new_param(out_local, in_local, dtype=torch.float8_e4m3fn, shard=shard)
        self.weight_scale_inv = new_param(_blocks(out_local), _blocks(in_local), dtype=torch.float32, shard=shard)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, fp8 128x128 blocks"


class Fp8ColumnParallelLinear(_Fp8BlockLinear):
    """ColumnParallelLinear's split (output features; `shard` overrides `(tp_rank, tp_size)`), FP8-block weight."""

    def __init__(self, *, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 shard: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        rank, size = shard if shard is not None else (tp_rank, tp_size)
        local = _block_split(out_features, size, "out_features")
        self._params(local, in_features, (0, rank, size))
        self.bias = new_param(local, dtype=dtype, shard=(0, rank, size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_block_linear(x, self.weight, self.weight_scale_inv)
        return y if self.bias is None else y + self.bias


class Fp8RowParallelLinear(_Fp8BlockLinear):
    """RowParallelLinear's split (input features, partial sums reduced over TP unless `reduce=False`), FP8-block weight."""

    def __init__(self, *, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 reduce: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        local = _block_split(in_features, tp_size, "in_features")
        self.reduce = reduce and tp_size > 1
        if bias and tp_size > 1 and not reduce:
            raise ValueError("a row-split linear with a bias must reduce, or the bias would be summed tp_size times")
        self._params(out_features, local, (1, tp_rank, tp_size))
        self.bias = new_param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_block_linear(x, self.weight, self.weight_scale_inv)
        if self.reduce:
            y = parallel.all_reduce(y, parallel.TP)
        if self.bias is not None:
            y = y + self.bias
        return y

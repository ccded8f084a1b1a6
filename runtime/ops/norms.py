"""RMS norms: the per-vector RMSNorm of every family, its zero-centred `1 + w` form, a SiLU-gated one, and a TP-split one.

The statistic is always computed in fp32. Where the weight is applied differs by family, and it shows in
bf16: Llama-style models (DeepSeek, Qwen3, Mixtral, GLM, MiniMax) cast the normalised vector back to the
input dtype and then multiply by the weight; gpt-oss and Qwen3-Next multiply in fp32 and cast last. That
is the `multiply_in_fp32` switch, so a build reproduces its reference to the last bit it can. On CUDA
`RMSNorm` runs as one Triton kernel (`runtime.kernels.rms_norm`) with the same numerics.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import parallel
from runtime.kernels import rms_norm as rms_norm_kernel
from runtime.ops.linear import new_param, split


class RMSNorm(nn.Module):
    """`x / rms(x) * w` over the last dim; `zero_centered=True` stores `w - 1` and applies `1 + w` (Qwen3-Next)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        eps: float,
        zero_centered: bool = False,
        multiply_in_fp32: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = float(eps)
        self.zero_centered = zero_centered
        # The zero-centred form is only defined with the fp32 multiply (that is how its checkpoints train).
        self.multiply_in_fp32 = multiply_in_fp32 or zero_centered
        self.weight = new_param(hidden_size, dtype=dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`, the sum rounded to the input dtype as torch's add rounds it;
        on CUDA one kernel launch for both."""
        if rms_norm_kernel.applies(x, self.weight) and residual.shape == x.shape and residual.dtype == x.dtype \
                and residual.stride(-1) == 1:
            return rms_norm_kernel.rms_norm(x, self.weight, self.eps, self.multiply_in_fp32, self.zero_centered, residual)
        total = residual + x
        return self(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm_kernel.applies(x, self.weight):
            return rms_norm_kernel.rms_norm(x, self.weight, self.eps, self.multiply_in_fp32, self.zero_centered)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.multiply_in_fp32:
            scale = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
            return (normed * scale).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`forward(x, gate)`: `w * (x / rms(x))` cast to the input dtype, times `silu(gate)` in fp32 (Qwen3-Next's
    gated DeltaNet output norm; `w` is applied as stored, not zero-centred)."""

    def __init__(self, *, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = new_param(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (MiniMax-M2 per-layer qk-norm) that may be split across TP ranks.

    The statistic spans every head, so under TP each rank holds part of the vector: the sum of squares is
    all-reduced and divided by `local_size * tp_size`. That is also right when key/value heads are
    replicated (fewer heads than ranks): each head then appears equally often across ranks, so the mean
    over all ranks' elements equals the mean over the true vector. `shard = (rank, count)` says which chunk
    of the checkpoint weight this rank holds (defaults to `(tp_rank, tp_size)`).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        eps: float,
        tp_rank: int = 0,
        tp_size: int = 1,
        shard: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank, count = shard if shard is not None else (tp_rank, tp_size)
        self.local_size = split(hidden_size, count, "normalised size")
        self.tp_size = tp_size
        self.eps = float(eps)
        self.weight = new_param(self.local_size, dtype=dtype, shard=(0, rank, count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(dim=-1, keepdim=True)
        if self.tp_size > 1:
            sum_sq = parallel.all_reduce(sum_sq, parallel.TP)
        normed = xf * torch.rsqrt(sum_sq / (self.local_size * self.tp_size) + self.eps)
        return self.weight * normed.to(x.dtype)

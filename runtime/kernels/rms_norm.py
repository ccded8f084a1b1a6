"""RMSNorm in one Triton kernel launch on CUDA (torch's path is six: cast, square, mean, rsqrt, scale, multiply).

The same numerics as `runtime.ops.norms.RMSNorm`: the statistic in fp32, then either the normalised
vector rounded to the input dtype times the weight (each product rounded, as torch's bf16 multiply
does), or the multiply in fp32 and one rounding (`multiply_in_fp32`, with `1 + w` when zero-centred).
Triton is imported on first use, so CPU-only hosts never need it; where it is missing `applies` says no
and the caller keeps torch's path. One program per row; the row fits one block (hidden sizes up to
`MAX_SIZE`), so it is read once. With a residual it also adds it first (the pre-norm layer's `h + attn`)
and writes the sum: one launch for what was an add and a norm.
"""
from __future__ import annotations

import torch

from runtime.kernels.triton_import import triton_kernels

MAX_SIZE = 16384


def _kernel():
    return triton_kernels("runtime.kernels.rms_norm_triton", "rms_norm_rows")


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == weight.dtype and x.stride(-1) == 1 and x.shape[-1] <= MAX_SIZE
            and x.numel() > 0 and _kernel() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, multiply_in_fp32: bool, zero_centered: bool,
             residual: torch.Tensor | None = None):
    """The normed rows; with `residual` (same shape and dtype as `x`), `(norm(x + residual), x + residual)`."""
    triton, kernel = _kernel()
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.reshape(-1, n)
    total = None if residual is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = max(1, min(16, block // 256))
    kernel[(rows.shape[0],)](rows, weight, out, rows if res is None else res, out if total is None else total,
                             rows.stride(0), out.stride(0), rows.stride(0) if res is None else res.stride(0), n, eps,
                             BLOCK=block, FP32_MUL=multiply_in_fp32, ZERO_CENTERED=zero_centered,
                             RESIDUAL=residual is not None, num_warps=warps)
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)

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

import functools

import torch

MAX_SIZE = 16384


@functools.lru_cache(maxsize=None)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, r_ptr, s_ptr, x_stride, y_stride, r_stride, n, eps,
                      BLOCK: tl.constexpr, FP32_MUL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                      RESIDUAL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + row * x_stride + offs, mask=keep, other=0.0).to(tl.float32)
        if RESIDUAL:
            # The residual sum rounded to the input dtype (torch's bf16 add), written out, then normed.
            r = tl.load(r_ptr + row * r_stride + offs, mask=keep, other=0.0).to(tl.float32)
            x = (x + r).to(y_ptr.dtype.element_ty)
            tl.store(s_ptr + row * y_stride + offs, x, mask=keep)
            x = x.to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if FP32_MUL:
            if ZERO_CENTERED:
                w = w + 1.0
            y = normed * w
        else:
            y = w * normed.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * y_stride + offs, y.to(y_ptr.dtype.element_ty), mask=keep)

    return triton, rms_norm_rows


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

"""Rotary embedding of q or k in one Triton kernel launch on CUDA (torch's path is about eight: slices,
casts, four products, two sums, concatenations).

The same function and rounding as `runtime.ops.rotary.apply_rotary`: cos and sin rounded to the input
dtype first, then each output element `x[d] * c -/+ x[partner] * s` with both products and the sum
rounded to the input dtype (what torch's bf16 arithmetic does); half-split or interleaved pairs; dims
past the rotated ones copied. One program per (token, head). Triton is imported on first use; where it
is missing `applies` says no and the caller keeps torch's path.
"""
from __future__ import annotations

import torch

from runtime.kernels.triton_import import triton_kernels


def _kernel():
    return triton_kernels("runtime.kernels.rotary_triton", "rotate")


def applies(x: torch.Tensor, cos: torch.Tensor, interleaved: bool) -> bool:
    """x `[B, S, H, D]` with unit last stride and one token stride over B*S; cos `[S, half]` contiguous fp32;
    half-split pairs only (interleaved pairs, MLA's, keep torch's path: on an H200 the kernel's interleaved
    outputs differed from torch's by one bf16 rounding in some elements, 2026-12-01, cause not found)."""
    if interleaved or not (x.is_cuda and x.dim() == 4 and x.stride(-1) == 1 and x.shape[0] * x.shape[1] > 0):
        return False
    if x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return False
    return cos.is_contiguous() and cos.dim() == 2 and cos.shape[0] == x.shape[1] and _kernel() is not None


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    triton, kernel = _kernel()
    batch, seq, heads, dim = x.shape
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device)
    kernel[(batch * seq, heads)](x, cos, sin.contiguous(), out, seq, x.stride(1), x.stride(2), dim,
                                 HALF=cos.shape[-1], BLOCK=triton.next_power_of_2(dim), INTERLEAVED=interleaved,
                                 num_warps=1 if dim <= 256 else 4)
    return out

"""One Triton launch from the fused q/k/v projection to the attention inputs: per-head RMSNorm of q and k,
rotary on both, q written out and k and v written into the static cache at their positions.

The unfused path is five to seven launches per layer (q-norm, k-norm, two rotaries, two cache writes and
the copies that make the projection's slices contiguous). Numerics are those of the unfused kernels step
by step (`runtime.kernels.rms_norm`, `runtime.kernels.rotary`, `StaticCache.update`): the norm statistic
in fp32, the normalised row rounded to the input dtype then times the weight (or the fp32 multiply, `1 + w`
when zero-centred), cos and sin rounded to the input dtype, each rotary product and the sum rounded, the
cache store cast to the cache dtype. Half-split pairs only; the rotated dims are the first `2 * half`.
One program per (token, head): query heads first, then one per key/value head writing both.
Triton is imported on first use; where it is missing `applies` says no and the caller keeps the unfused path.
"""
from __future__ import annotations

import torch

from runtime.kernels.triton_import import triton_kernels


def _kernel():
    return triton_kernels("runtime.kernels.rotary_cache_triton", "qkv_rope_cache")


def applies(qkv: torch.Tensor, cos: torch.Tensor | None, first: torch.Tensor, second: torch.Tensor) -> bool:
    """`qkv [B, S, N]` CUDA with unit last stride and one token stride; `cos [S, half]` contiguous fp32 (or
    None: no rotation); cache buffers `[B, H, L, D]` with unit last stride."""
    if not (qkv.is_cuda and qkv.dim() == 3 and qkv.stride(-1) == 1 and qkv.shape[0] * qkv.shape[1] > 0):
        return False
    if qkv.shape[0] > 1 and qkv.stride(0) != qkv.shape[1] * qkv.stride(1):
        return False
    if cos is not None and not (cos.is_contiguous() and cos.dim() == 2 and cos.shape[0] == qkv.shape[1]
                                and cos.dtype == torch.float32):
        return False
    if first.stride(-1) != 1 or second.stride(-1) != 1:
        return False
    return _kernel() is not None


def apply(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    first: torch.Tensor,
    second: torch.Tensor,
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_head_stride: int,
    k_offset: int,
    v_offset: int,
    eps: float = 0.0,
    multiply_in_fp32: bool = False,
    zero_centered: bool = False,
) -> torch.Tensor:
    """Rotated (and normed) queries `[B, S, q_heads, head_dim]`; keys and values go into `first`/`second`
    `[B, kv_heads, L, head_dim]` at `positions [S]` (in `[0, L)`: the caller's contract, as in StaticCache)."""
    triton, kernel = _kernel()
    batch, seq, _ = qkv.shape
    q = torch.empty(batch, seq, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = 0 if cos is None else cos.shape[-1]
    norm = q_norm is not None
    table = qkv if cos is None else cos
    kernel[(batch * seq, q_heads + kv_heads)](
        qkv, positions, table, table if sin is None else sin.contiguous(),
        q_norm if norm else qkv, k_norm if norm else qkv, q, first, second,
        seq, qkv.stride(1), q_head_stride, k_offset, v_offset, q_heads, head_dim, float(eps),
        first.stride(0), first.stride(1), first.stride(2), second.stride(0), second.stride(1), second.stride(2),
        HALF=half, BLOCK=triton.next_power_of_2(head_dim), NORM=norm, FP32_MUL=multiply_in_fp32,
        ZERO_CENTERED=zero_centered, num_warps=1 if head_dim <= 256 else 4,
    )
    return q

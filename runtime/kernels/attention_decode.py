"""One cached decode step of grouped-query attention in two Triton launches: split-K partials over blocks of
the static cache (each program: one key/value head, its G query heads, a run of BLOCK_N-slot blocks; scores, the
mask from positions, an online softmax), then their combination, with gpt-oss's sink logit joining the normaliser.

Torch's path for the same step is three mask kernels (positions -> boolean -> additive) and cuDNN's
two, or for sinks the memory-efficient kernel with a folded bias and a rescale (~67 µs per call at
gpt-oss shapes on an H200, 2026-12-01). Numerics: fp32 scores and softmax, the (unnormalised) probabilities
rounded to the value dtype for the product with V (as flash kernels do; the eager reference rounds the
normalised ones), fp32 accumulation: within bf16 rounding of `attention_core.eager_attention`.
Shapes and positions as `attention_core.attention`, one query token. Triton is imported on first use.
"""
from __future__ import annotations

import functools

import torch

from runtime.kernels.triton_import import triton_kernels

BLOCK_N = 64


def _kernels():
    return triton_kernels("runtime.kernels.attention_decode_triton", "decode_partials", "decode_combine")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> bool:
    """A one-token step (`q [B, 1, Hq, D]`) over `k`/`v [B, Hkv, L, D]` of q's dtype on CUDA, D a power of two
    from 16 to 256, at most 64 query heads per key/value head."""
    if not (q.is_cuda and q.dim() == 4 and q.shape[1] == 1 and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    batch, _, q_heads, dim = q.shape
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape[-1] != dim or v.shape[-1] != dim or k.shape[1] == 0:
        return False
    if dim not in (16, 32, 64, 128, 256) or q_heads % k.shape[1] or q_heads // k.shape[1] > 64:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(2) != dim:
        return False
    if q_positions.numel() != 1 or k_positions.dim() != 1 or k_positions.shape[0] != k.shape[2]:
        return False
    return _kernels() is not None


def attention(q, k, v, q_positions, k_positions, scale: float, sliding_window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, 1, Hq, D]` in q's dtype."""
    triton, partials, combine = _kernels()
    batch, _, q_heads, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    g_pad = max(16, triton.next_power_of_2(group))
    # Enough programs for two per SM, each over whole blocks: few splits (and little scratch) at large batch.
    splits = max(1, min(triton.cdiv(length, BLOCK_N), triton.cdiv(2 * _sm_count(q.device), batch * kv_heads)))
    rows = batch * kv_heads * group * splits
    m = torch.empty(rows, dtype=torch.float32, device=q.device)
    l = torch.empty(rows, dtype=torch.float32, device=q.device)
    acc = torch.empty(rows, dim, dtype=torch.float32, device=q.device)
    partials[(batch * kv_heads, splits)](
        q, k, v, q_positions, k_positions, m, l, acc, kv_heads, length,
        0 if sliding_window is None else int(sliding_window), float(scale),
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        GROUP=group, G_PAD=g_pad, DIM=dim, BLOCK_N=BLOCK_N, WINDOW=sliding_window is not None, num_warps=4,
    )
    out = torch.empty(batch, 1, q_heads, dim, dtype=q.dtype, device=q.device)
    combine[(batch * q_heads,)](
        m, l, acc, q if sinks is None else sinks, out, kv_heads, splits,
        GROUP=group, G_PAD=g_pad, DIM=dim, CHUNK=min(32, triton.next_power_of_2(splits)), SINKS=sinks is not None,
        num_warps=4,
    )
    return out

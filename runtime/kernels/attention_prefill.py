"""Grouped-query attention of a block of queries (a prompt, or a prompt block over the static cache) in one
Triton launch: flash attention with the mask made from positions inside the kernel, sliding windows, and
gpt-oss's sink logit joining the softmax normaliser.

Torch's flash and cuDNN kernels take no sinks; their stand-in, the memory-efficient kernel over folded heads
with an additive bias built per call, took 0.79 ms per gpt-oss layer at 2048 tokens on an H200 (2026-12-01),
every key tile included. Here each program holds BLOCK_M rows: the G query heads of one key/value head at
BLOCK_M / G consecutive queries, so a K/V tile is read once for its G heads (no repeat) and a sliding
window's band spans W + BLOCK_M / G keys; key tiles outside every row's band are never visited, and those
every row sees whole (the causal interior, the window's middle) skip the mask.

Numerics as `runtime.kernels.attention_decode`: fp32 scores and online softmax (base 2), the unnormalised
probabilities rounded to the value dtype for the product with V, fp32 accumulation. Shapes and positions as
`attention_core.attention`; key positions strictly increasing (the static cache's slots, a prompt's own
positions), which the band's bounds rely on; the mask itself is exact for any positions.
Triton is imported on first use.
"""
from __future__ import annotations

import math

import torch

from runtime.kernels.triton_import import triton_kernels

BLOCK_M = 128
BLOCK_N = 64


def _kernel():
    return triton_kernels("runtime.kernels.attention_prefill_triton", "prefill_attention")


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
            k_positions: torch.Tensor) -> bool:
    """`q [B, S, Hq, D]` over `k`/`v [B, Hkv, L, D]`, all bf16 or fp16 on CUDA, D a power of two from 16 to 128,
    unit last strides, one position per query and per key."""
    if not (q.is_cuda and q.dim() == 4 and q.dtype in (torch.bfloat16, torch.float16) and q.shape[1] > 0):
        return False
    dim = q.shape[-1]
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape[-1] != dim or v.shape[-1] != dim:
        return False
    if dim not in (16, 32, 64, 128) or k.shape[1] == 0 or q.shape[2] % k.shape[1] or k.shape[2] == 0:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    return (q_positions.dim() == 1 and q_positions.shape[0] == q.shape[1] and k_positions.dim() == 1
            and k_positions.shape[0] == k.shape[2] and _kernel() is not None)


def attention(q, k, v, q_positions, k_positions, scale: float, sliding_window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, S, Hq, D]` in q's dtype."""
    triton, kernel = _kernel()
    batch, seq, q_heads, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    out = torch.empty(batch, seq, q_heads, dim, dtype=q.dtype, device=q.device)
    kernel[(triton.cdiv(seq * group, BLOCK_M), batch * kv_heads)](
        q, k, v, q_positions, k_positions, q if sinks is None else sinks.contiguous(), out,
        seq, length, kv_heads, 0 if sliding_window is None else int(sliding_window), float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WINDOW=sliding_window is not None,
        SINKS=sinks is not None, num_warps=4 if dim <= 64 else 8, num_stages=3,
    )
    return out

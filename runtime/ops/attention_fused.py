"""Attention on CUDA through torch's fused scaled-dot-product kernels, reading bf16 keys and values in place.

Paths chosen from shapes and flags only (never from tensor values, so a decode step captures in a
CUDA graph):

- a one-token step over the cache (GQA, sinks and windows too): `runtime.kernels.attention_decode`, a
  split-K Triton kernel reading K/V in place, the mask computed from positions inside it;

- keys are the queries' own tokens with a plain causal mask (prefill without a window or sinks):
  `scaled_dot_product_attention(is_causal=True, enable_gqa=...)`, the flash kernel, no mask tensor and
  no repeated K/V;
- a block of queries with a sliding window or sinks (a prompt, or a prompt block over the static cache):
  `runtime.kernels.attention_prefill`, a Triton flash kernel making the mask from positions, skipping the
  key tiles outside the window, the sink joining the normaliser (bf16/fp16, head dims 16 to 128);
- a cached step over the static cache without either, or what the kernels above do not take: SDPA with
  `enable_gqa` and a boolean `[S, L]` mask built from positions (cuDNN's kernel on an H200; K/V never
  repeated);
- gpt-oss sinks there: the G query heads that share a key/value head are folded into G*S query rows of that
  head (`[B, Hkv, G*S, D]`, a copy of q only) for the memory-efficient kernel, which also returns each
  row's log-sum-exp `lse`; a sink logit `s` joining the softmax scales the row's output by
  `e^lse / (e^lse + e^s)` = `sigmoid(lse - s)`, which is exact.

Shapes as `attention_core.attention`. Kernels accumulate in fp32; inputs and outputs stay in their dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import attention_decode, attention_prefill
from runtime.ops.attention_core import allowed_keys

# The memory-efficient kernel reads its bias in rows whose stride is a multiple of 16 elements.
_BIAS_ALIGN = 16


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    self_keys: bool = False,
) -> torch.Tensor:
    batch, seq, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    if not self_keys and attention_decode.applies(q, k, v, q_positions, k_positions):
        # A one-token step over the cache, sinks and windows included: the split-K Triton kernel.
        return attention_decode.attention(q, k, v, q_positions, k_positions, scale, sliding_window, sinks)
    if self_keys and sliding_window is None and sinks is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=group > 1
        )
        return out.transpose(1, 2)
    if (sliding_window is not None or sinks is not None) and attention_prefill.applies(
        q, k, v, q_positions, k_positions
    ):
        # A block of queries with a window or sinks, which torch's flash kernels lack: the Triton flash kernel.
        return attention_prefill.attention(q, k, v, q_positions, k_positions, scale, sliding_window, sinks)

    if sinks is None:
        allowed = allowed_keys(q_positions, k_positions, sliding_window)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=allowed, scale=scale, enable_gqa=group > 1
        )
        return out.transpose(1, 2)
    rows = group * seq
    qf = q.view(batch, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, rows, dim)
    bias = folded_bias(q_positions, k_positions, sliding_window, group, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        qf, k, v, bias.expand(batch, kv_heads, rows, k.shape[2]), True, scale=scale
    )[:2]
    sink = sinks.float().view(kv_heads, group, 1).expand(kv_heads, group, seq).reshape(kv_heads, rows)
    out = (out.float() * torch.sigmoid(lse[..., :rows] - sink).unsqueeze(-1)).to(q.dtype)
    return out.view(batch, kv_heads, group, seq, -1).permute(0, 3, 1, 2, 4).reshape(batch, seq, q_heads, -1)


def folded_bias(
    q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """`[1, 1, G*S, L]` additive mask (0 or -inf) of the folded rows (row g*S + s is query s), in a buffer
    whose rows are 16-element aligned."""
    allowed = allowed_keys(q_positions, k_positions, sliding_window).repeat(group, 1)
    length = allowed.shape[1]
    padded = -(-length // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros(allowed.shape[0], padded, dtype=dtype, device=allowed.device)
    bias[:, :length].masked_fill_(~allowed, float("-inf"))
    return bias[None, None, :, :length]

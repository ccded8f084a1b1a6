"""Scaled dot-product attention over positions: causal and sliding-window masks, GQA grouping, gpt-oss sinks.

Shared by GQA and MLA so the masking rule exists once. The mask is computed from position tensors
(`key <= query`, and `key > query - window` for sliding layers, the window counting the query itself as
in transformers), never from Python lengths, so prefill, a cached decode step and a CUDA-graph replay
run the same code. `attention` runs the fused kernels of `attention_fused` on CUDA and `eager_attention`
elsewhere; the eager one is also the tests' oracle for the fused one. Its logits and softmax are fp32;
probabilities are cast to the value dtype for the last matmul, as transformers' eager path does.
"""
from __future__ import annotations

import torch


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
    """`q [B, S, Hq, D]`, `k [B, Hkv, L, D]`, `v [B, Hkv, L, Dv]` (heads-major, the cache's layout) ->
    `[B, S, Hq, Dv]`; `Hq` a multiple of `Hkv`.

    `sinks [Hq]`: one learned logit per head that joins every softmax and is then dropped (gpt-oss), so a
    head can attend to "nothing". `self_keys`: the keys are the queries' own tokens (no cache), so with
    increasing positions the mask is plain causal, which the fused path runs without building a mask.
    """
    if q.is_cuda:
        from runtime.ops import attention_fused

        return attention_fused.attention(q, k, v, q_positions, k_positions, scale, sliding_window, sinks, self_keys)
    return eager_attention(q, k, v, q_positions, k_positions, scale, sliding_window, sinks)


def allowed_keys(q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """`[S, L]` booleans: which keys each query sees."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed = allowed & (k_positions[None, :] > q_positions[:, None] - sliding_window)
    return allowed


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: fp32 logits and softmax over the whole `[S, L]` score matrix; shapes as `attention`."""
    batch, seq, q_heads, _ = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    # [B, Hkv, G, S, D] against [B, Hkv, 1, L, D]: query heads h*G .. h*G+G-1 share kv head h (repeat_kv order).
    qh = q.view(batch, seq, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    kh = k.unsqueeze(2)
    vh = v.unsqueeze(2)
    logits = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~allowed_keys(q_positions, k_positions, sliding_window), float("-inf"))

    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.float().view(kv_heads, group, 1, 1).expand(batch, kv_heads, group, seq, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(v.dtype), vh)  # [B, Hkv, G, S, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, q_heads, -1)

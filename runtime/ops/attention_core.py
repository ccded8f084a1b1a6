"""Scaled dot-product attention over positions: causal and sliding-window masks, GQA grouping, gpt-oss sinks.

Shared by GQA and MLA so the masking rule exists once. The mask is computed from position tensors
(`key <= query`, and `key > query - window` for sliding layers, the window counting the query itself as
in transformers), never from Python lengths, so prefill, a cached decode step and a CUDA-graph replay
run the same code. Logits and softmax are fp32; probabilities are cast to the value dtype for the last
matmul, as transformers' eager path does.
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
) -> torch.Tensor:
    """`q [B, S, Hq, D]`, `k [B, L, Hkv, D]`, `v [B, L, Hkv, Dv]` -> `[B, S, Hq, Dv]`; `Hq` a multiple of `Hkv`.

    `sinks [Hq]`: one learned logit per head that joins every softmax and is then dropped (gpt-oss), so a
    head can attend to "nothing".
    """
    batch, seq, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    # [B, Hkv, G, S, D] against [B, Hkv, 1, L, D]: query heads h*G .. h*G+G-1 share kv head h (repeat_kv order).
    qh = q.view(batch, seq, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    kh = k.permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)
    logits = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale

    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed = allowed & (k_positions[None, :] > q_positions[:, None] - sliding_window)
    logits = logits.masked_fill(~allowed, float("-inf"))

    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.float().view(kv_heads, group, 1, 1).expand(batch, kv_heads, group, seq, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(v.dtype), vh)  # [B, Hkv, G, S, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, q_heads, -1)

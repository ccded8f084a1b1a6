"""DeepSeek multi-head latent attention (MLA): DeepSeek-V2/V3, Kimi-K2.

Keys and values come from one compressed latent per token (`kv_lora_rank` wide, RMS-normed) plus one
rotated key part shared by all heads (`qk_rope_head_dim`); the cache stores exactly those two, which is
the point of MLA. Queries come either straight from the hidden state (`q_lora_rank=None`, V2-Lite style)
or through their own low-rank bottleneck. Without a cache (prefill of a whole sequence) the latents are
expanded through `kv_b_proj` into per-head keys and values (also when a prompt is written into the
cache); a cached step of a few tokens (a decode step, a speculative verify) runs in the absorbed form, in the
latent space (`_absorbed`), reading the cache as it is stored instead of expanding all of it.

Tensor parallelism splits the heads: `q_proj`/`q_b_proj` and `kv_b_proj` by output columns, `o_proj` by
input rows. `q_a_proj`, `kv_a_proj_with_mqa` and the two latent norms are small and replicated.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from runtime.ops.attention_core import attention, eager_attention
from runtime.ops.kv_cache import StaticCache
from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, split
from runtime.ops.norms import RMSNorm
from runtime.ops.rotary import apply_rotary


# Cached steps of up to this many tokens (a decode step, a speculative verify of k + 1 <= 8 tokens) attend in
# the absorbed form. Expanded, each would run `kv_b_proj` over the whole cache (B x L x heads x 256 values a
# layer: 2.3 GB at deepseek_v3's 128 heads, B = 32, L = 1088); absorbed, the scores the math path holds are
# B x S x heads x L fp32, small for these S and growing with S, so longer prompts are expanded.
ABSORBED_MAX_TOKENS = 8


class MLAttention(nn.Module):
    """`forward(hidden [B, S, H], positions [S], cos, sin, cache=None) -> [B, S, H]`.

    `softmax_scale` is a number the template inlines: `rotary.mla_softmax_scale(...)` computes it as
    transformers does (`(nope + rope)^-0.5`, times the YaRN mscale squared when `mscale_all_dim` is set).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        interleaved_rope: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.local_heads = split(num_heads, tp_size, "num_attention_heads")
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = float(softmax_scale)
        self.interleaved_rope = interleaved_rope
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)

        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                in_features=hidden_size, out_features=num_heads * self.qk_head_dim, dtype=dtype, **tp
            )
        else:
            # transformers gives q_a_proj the attention bias too; q_b_proj never has one.
            self.q_a_proj = ColumnParallelLinear(  # replicated: tp_size stays 1
                in_features=hidden_size, out_features=q_lora_rank, bias=attention_bias, dtype=dtype
            )
            self.q_a_layernorm = RMSNorm(hidden_size=q_lora_rank, eps=rms_norm_eps, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(
                in_features=q_lora_rank, out_features=num_heads * self.qk_head_dim, dtype=dtype, **tp
            )
        self.kv_a_proj_with_mqa = ColumnParallelLinear(  # replicated
            in_features=hidden_size, out_features=kv_lora_rank + qk_rope_head_dim, bias=attention_bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(hidden_size=kv_lora_rank, eps=rms_norm_eps, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(
            in_features=kv_lora_rank, out_features=num_heads * (qk_nope_head_dim + v_head_dim), dtype=dtype, **tp
        )
        self.o_proj = RowParallelLinear(
            in_features=num_heads * v_head_dim, out_features=hidden_size, bias=attention_bias, dtype=dtype, **tp
        )
        self.q_lora = q_lora_rank is not None

    def new_cache(
        self, *, batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> StaticCache:
        """Latent `[B, 1, L, kv_lora_rank]` and rotated shared key `[B, 1, L, qk_rope_head_dim]`, packed in one
        buffer (the absorbed decode reads both as one key)."""
        return StaticCache(
            batch_size=batch_size, max_seq_len=max_seq_len, first_shape=(1, self.kv_lora_rank),
            second_shape=(1, self.qk_rope_head_dim), dtype=dtype, device=device, packed=True,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(batch, seq, self.local_heads, self.qk_head_dim)
        q_nope, q_rot = q.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)

        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = apply_rotary(q_rot, cos, sin, self.interleaved_rope)
        k_rot = apply_rotary(k_rot.view(batch, seq, 1, self.qk_rope_head_dim), cos, sin, self.interleaved_rope)

        if cache is not None and seq <= ABSORBED_MAX_TOKENS:
            return self.o_proj(self._absorbed(q_nope, q_rot, latent, k_rot, positions, cache).reshape(batch, seq, -1))
        if cache is None:
            k_positions = positions
        else:  # a prompt written into the cache: expanded, as without a cache (the same rounding as a full forward)
            latent, k_rot = cache.update(positions, latent[:, :, None], k_rot)
            latent, k_rot = latent[:, 0], k_rot.transpose(1, 2)
            k_positions = cache.positions
        length = latent.shape[1]
        kv = self.kv_b_proj(latent).view(batch, length, self.local_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        # Two copies into fresh buffers, not `torch.cat`: its kernel for these strided and broadcast inputs
        # took 254 µs per call at 2048 tokens on an H200 (2 ms of deepseek_v3's 4-layer prefill).
        k = kv.new_empty(batch, length, self.local_heads, self.qk_head_dim)
        k[..., : self.qk_nope_head_dim] = k_nope
        k[..., self.qk_nope_head_dim :] = k_rot
        q[..., self.qk_nope_head_dim :] = q_rot   # q_nope is q's own slice already
        out = attention(
            q, k.transpose(1, 2), v.transpose(1, 2), positions, k_positions, self.scale, self_keys=cache is None
        )
        return self.o_proj(out.reshape(batch, seq, -1))

    def _absorbed(self, q_nope, q_rot, latent, k_rot, positions, cache: StaticCache) -> torch.Tensor:
        """Attention in the latent space over the cache: `q_nope . (W_uk c) = (W_uk^T q_nope) . c`, so each
        query head scores the cached latents `c` directly (one shared key head `[c, k_rot]`, the packed
        cache as it is), and `W_uv` maps the attended latent to the head's values afterwards. The cache is
        never expanded through `kv_b_proj`."""
        cache.update(positions, latent[:, :, None], k_rot)
        w = self.kv_b_proj.weight.view(self.local_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split((self.qk_nope_head_dim, self.v_head_dim), dim=1)
        q = torch.cat((torch.einsum("bshd,hdr->bshr", q_nope, w_uk), q_rot), dim=-1)
        batch, seq, heads, _ = q.shape
        # One key head serves every query head: fold the heads into `seq * heads` query rows of that head
        # (row s * heads + h at position s), so each product is one batched matmul over the cache as stored,
        # on CUDA too. Left as GQA, SDPA repeats the 576-wide cache once per head (deepseek_v3 B=32: 88 ms
        # a step); folded, its only kernel for 576-wide heads is the memory-efficient one: 118 µs a layer at
        # B=1 on an H200 (bench/build.py --profile, 2026-12-01), its 32-row tiles leaving most SMs idle.
        rows = q.reshape(batch, seq * heads, 1, -1)
        out = eager_attention(rows, cache.packed, cache.first, positions.repeat_interleave(heads), cache.positions,
                              self.scale)
        return torch.einsum("bshr,hvr->bshv", out.view(batch, seq, heads, -1), w_uv)

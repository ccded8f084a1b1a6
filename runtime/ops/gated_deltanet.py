"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attn`) and the fixed-size state it decodes from.

The mixer projects each token to query, key and value heads (grouped: each key head serves
`num_v_heads // num_k_heads` value heads), runs them through a short causal depthwise convolution with
SiLU, and reads them with the gated delta rule: per value head a `[k_dim, v_dim]` memory is decayed by
`exp(g)` and corrected toward each new value by `beta` (the delta rule), and each query reads it. The
output is RMS-normed per head, gated by `silu(z)` and projected back.

Its decode cache is not a per-position buffer but two fixed tensors per layer (`RecurrentState`): the
last `kernel - 1` convolution inputs and the fp32 memory. Fixed shapes and in-place writes, so a decode
step captures in a CUDA graph. A forward that starts at position 0 (a prefill) starts from an empty
state; the reset is a multiply by `positions[0] > 0`, not a branch, so it needs no host sync. A state
cannot be rolled back: verifying several drafted tokens and rejecting some would leave it advanced.

The recurrence runs token by token in fp32 (the reference's recurrent form; its chunked form computes
the same sums in another order). Under tensor parallelism the mixer is not split (`tp_size` must be 1).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, new_param
from runtime.ops.norms import GatedRMSNorm

L2_EPS = 1e-6   # the reference's l2 normalization of queries and keys


class RecurrentState:
    """`conv [B, conv_dim, kernel - 1]` (the last convolution inputs) and `memory [B, v_heads, k_dim, v_dim]` (fp32)."""

    def __init__(self, *, batch_size: int, conv_dim: int, kernel: int, v_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        self.conv = torch.zeros(batch_size, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.memory = torch.zeros(batch_size, v_heads, k_dim, v_dim, dtype=torch.float32, device=device)

    @property
    def advanced_in_place(self) -> tuple[torch.Tensor, ...]:
        """What a step updates from its old value (not a slot at its position): a graph's warm-up must undo it."""
        return (self.conv, self.memory)


class DepthwiseConv(nn.Module):
    """The checkpoint's `conv1d.weight [channels, 1, kernel]`, no bias (applied by `GatedDeltaNet`)."""

    def __init__(self, *, channels: int, kernel: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = new_param(channels, 1, kernel, dtype=dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta_rule(q, k, v, g, beta, memory):
    """Outputs `[B, S, Hv, Dv]` (fp32) and the final memory for `q, k [B, S, Hv, Dk]`, `v [B, S, Hv, Dv]`,
    decay logits `g` and write strengths `beta [B, S, Hv]`, from `memory [B, Hv, Dk, Dv]` (fp32)."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    outs = []
    for t in range(q.shape[1]):
        memory = memory * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        recalled = torch.einsum("bhkv,bhk->bhv", memory, kt)
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        memory = memory + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", memory, q[:, t]))
    return torch.stack(outs, dim=1), memory


class GatedDeltaNet(nn.Module):
    """`forward(hidden [B, S, H], positions [S], cos, sin, cache=None) -> [B, S, H]` (rotary unused).

    Submodules carry the checkpoint names: `in_proj_qkvz in_proj_ba conv1d dt_bias A_log norm out_proj`.
    """

    def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, rms_norm_eps: float, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if tp_size != 1:
            raise ValueError(f"the gated DeltaNet mixer is not split over tensor-parallel ranks; build it with tp1 (got tp{tp_size})")
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads {num_k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.kernel = conv_kernel
        self.conv_dim = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim
        qkvz = 2 * num_k_heads * k_head_dim + 2 * num_v_heads * v_head_dim
        self.in_proj_qkvz = ColumnParallelLinear(in_features=hidden_size, out_features=qkvz, dtype=dtype)
        self.in_proj_ba = ColumnParallelLinear(in_features=hidden_size, out_features=2 * num_v_heads, dtype=dtype)
        self.conv1d = DepthwiseConv(channels=self.conv_dim, kernel=conv_kernel, dtype=dtype)
        self.dt_bias = new_param(num_v_heads, dtype=dtype)
        self.A_log = new_param(num_v_heads, dtype=dtype)
        self.norm = GatedRMSNorm(hidden_size=v_head_dim, eps=rms_norm_eps, dtype=dtype)
        self.out_proj = RowParallelLinear(in_features=num_v_heads * v_head_dim, out_features=hidden_size, dtype=dtype)

    def new_cache(self, *, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                  device: torch.device | str | None = None) -> RecurrentState:
        # max_seq_len does not matter: the state has one size whatever the context length.
        return RecurrentState(batch_size=batch_size, conv_dim=self.conv_dim, kernel=self.kernel, v_heads=self.v_heads,
                              k_dim=self.k_dim, v_dim=self.v_dim, dtype=dtype, device=device)

    def _split(self, hidden: torch.Tensor):
        """q, k `[B, S, Hk * Dk]`, v, z `[B, S, Hv, Dv]`, b, a `[B, S, Hv]`: the projections are grouped per key head."""
        batch, seq, _ = hidden.shape
        ratio = self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(hidden).view(batch, seq, self.k_heads, -1)
        q, k, v, z = qkvz.split((self.k_dim, self.k_dim, ratio * self.v_dim, ratio * self.v_dim), dim=-1)
        b, a = self.in_proj_ba(hidden).view(batch, seq, self.k_heads, 2 * ratio).split((ratio, ratio), dim=-1)
        heads = (batch, seq, self.v_heads)
        return (q.reshape(batch, seq, -1), k.reshape(batch, seq, -1), v.reshape(*heads, self.v_dim),
                z.reshape(*heads, self.v_dim), b.reshape(heads), a.reshape(heads))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos=None, sin=None,
                cache: RecurrentState | None = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        q, k, v, z, b, a = self._split(hidden)
        mixed = torch.cat((q, k, v.reshape(batch, seq, -1)), dim=-1).transpose(1, 2)   # [B, C, S]
        weight = self.conv1d.weight
        if cache is None:
            past = mixed.new_zeros(batch, self.conv_dim, self.kernel - 1)
            memory = mixed.new_zeros(batch, self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        else:
            # A forward from position 0 starts fresh; later ones continue from the cached state.
            keep = (positions[:1] > 0).to(torch.float32)
            past, memory = cache.conv * keep.to(cache.conv.dtype), cache.memory * keep
        window = torch.cat((past.to(mixed.dtype), mixed), dim=-1)
        if cache is not None:
            cache.conv.copy_(window[:, :, -(self.kernel - 1):])
        mixed = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=self.conv_dim)).to(hidden.dtype).transpose(1, 2)
        key_width = self.k_heads * self.k_dim
        q, k, v = mixed.split((key_width, key_width, self.v_heads * self.v_dim), dim=-1)
        ratio = self.v_heads // self.k_heads
        q = q.reshape(batch, seq, self.k_heads, self.k_dim).repeat_interleave(ratio, dim=2)
        k = k.reshape(batch, seq, self.k_heads, self.k_dim).repeat_interleave(ratio, dim=2)
        v = v.reshape(batch, seq, self.v_heads, self.v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, memory = gated_delta_rule(q, k, v, g, beta, memory)
        if cache is not None:
            cache.memory.copy_(memory)
        out = self.norm(out.to(hidden.dtype), z)
        return self.out_proj(out.reshape(batch, seq, -1))

"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attn`) and the fixed-size state it decodes from.

The mixer projects each token to query, key and value heads (grouped: each key head serves
`num_v_heads // num_k_heads` value heads), runs them through a short causal depthwise convolution with
SiLU, and reads them with the gated delta rule: per value head a `[k_dim, v_dim]` memory is decayed by
`exp(g)` and corrected toward each new value by `beta` (the delta rule), and each query reads it. The
output is RMS-normed per head, gated by `silu(z)` and projected back.

Its decode cache is not a per-position buffer but two fixed tensors per layer (`RecurrentState`): the
last `kernel - 1` convolution inputs and the fp32 memory. Fixed shapes and in-place writes, so a decode
step captures in a CUDA graph. A forward that starts at position 0 (a prefill) starts from an empty
state (runtime/ops/recurrent.py, which also keeps the states a speculative verify rolls back to).

The delta rule runs in fp32 in one of two forms that compute the same sums in another order: token by
token (decode, short inputs, and blocks whose per-token states are kept), or, for inputs longer than a
chunk, chunked (`chunked_gated_delta_rule`: within a chunk the writes solve one unit-triangular system,
then one recurrence step per chunk). Under tensor parallelism each rank runs `1 / tp` of the key heads
with their value heads (the projections are grouped per key head, so a rank's rows are one chunk of
them; its conv channels are one chunk of each of the q, k, v segments), and `out_proj` sums the ranks.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, new_param
from runtime.ops.mamba import CausalConv1d
from runtime.ops.norms import GatedRMSNorm
from runtime.ops.recurrent import RecurrentCache

L2_EPS = 1e-6   # the reference's l2 normalization of queries and keys
CHUNK = 64      # the chunked form's chunk (the reference's): longer inputs run chunked


class RecurrentState(RecurrentCache):
    """`conv [B, conv_dim, kernel - 1]` (the last convolution inputs) and `memory [B, v_heads, k_dim, v_dim]` (fp32)."""

    def __init__(self, *, batch_size: int, conv_dim: int, kernel: int, v_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__(torch.zeros(batch_size, conv_dim, kernel - 1, dtype=dtype, device=device),
                         torch.zeros(batch_size, v_heads, k_dim, v_dim, dtype=torch.float32, device=device))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta_rule(q, k, v, g, beta, memory, keep_states: bool = False):
    """Outputs `[B, S, Hv, Dv]` (fp32) and the final memory for `q, k [B, S, Hv, Dk]`, `v [B, S, Hv, Dv]`,
    decay logits `g` and write strengths `beta [B, S, Hv]`, from `memory [B, Hv, Dk, Dv]` (fp32), token by
    token; with `keep_states`, also the memory after each token, `[S, B, Hv, Dk, Dv]`.

    Per token: `M <- exp(g) M`, then `M <- M + k (beta (v - M^T k))^T`, and the output is `M^T q`."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    outs, states = [], []
    for t in range(q.shape[1]):
        memory = memory * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        recalled = torch.einsum("bhkv,bhk->bhv", memory, kt)
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        memory = memory + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", memory, q[:, t]))
        states.append(memory)
    return torch.stack(outs, dim=1), memory, (torch.stack(states) if keep_states else None)


def _by_chunk(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, S, H, *]` -> `[B, H, S / chunk, chunk, *]`, zero-padded to whole chunks (a zero token with
    `g = beta = 0` leaves the memory as it was)."""
    x = x.transpose(1, 2)
    pad = (-x.shape[2]) % chunk
    x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def chunked_gated_delta_rule(q, k, v, g, beta, memory, chunk: int = CHUNK):
    """`gated_delta_rule`'s outputs and final memory, computed a chunk at a time.

    Within a chunk from memory `M0`, with `G_t` the decay accumulated from the chunk's start to token `t`,
    the token-by-token recurrence unrolls to `M_t = G_t M0 + sum_{s<=t} (G_t / G_s) k_s u_s^T`, where the
    write `u_t = beta_t (v_t - (G_t M0 + sum_{s<t} (G_t / G_s) k_s u_s^T)^T k_t)` depends on the earlier
    writes linearly: `(I + A) U = beta V - diag(beta G) K M0` with `A[t, s] = beta_t (G_t / G_s) k_t . k_s`
    (s < t). One unit-lower-triangular solve per chunk (for all chunks at once) gives `U = U0 - W M0`;
    the outputs are `diag(G) Q M0 + (Q K^T * G_t / G_s, s <= t) U` and the next chunk starts from
    `G_C M0 + K^T diag(G_C / G_s) U`. Only that last step runs chunk after chunk."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    seq, v_dim = q.shape[1], v.shape[-1]
    q, k, v, g, beta = (_by_chunk(x, chunk) for x in (q, k, v, g, beta))   # [B, H, N, C, *]
    cum = g.cumsum(-1)                                                       # log G_t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # G_t / G_s, s <= t
    coupling = (k @ k.transpose(-1, -2)) * ratio * beta[..., :, None]     # A below the diagonal
    # unitriangular: the solve reads only the strictly lower part and takes the diagonal as ones: I + A.
    solved = torch.linalg.solve_triangular(
        coupling, torch.cat((v * beta[..., None], k * (beta * cum.exp())[..., None]), dim=-1),
        upper=False, unitriangular=True)
    u0, w = solved.split((v_dim, k.shape[-1]), dim=-1)
    reads = (q @ k.transpose(-1, -2)) * ratio                                # s <= t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    through = cum[..., -1].exp()[..., None, None]                            # G_C, [B, H, N, 1, 1]
    outs = []
    for c in range(q.shape[2]):
        u = u0[:, :, c] - w[:, :, c] @ memory
        outs.append(q_decayed[:, :, c] @ memory + reads[:, :, c] @ u)
        memory = memory * through[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :seq]                # [B, H, S, Dv]
    return out.transpose(1, 2), memory


class GatedDeltaNet(nn.Module):
    """`forward(hidden [B, S, H], positions [S], cos, sin, cache=None) -> [B, S, H]` (rotary unused).

    Submodules carry the checkpoint names: `in_proj_qkvz in_proj_ba conv1d dt_bias A_log norm out_proj`.
    """

    def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, rms_norm_eps: float, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads {num_k_heads}")
        if num_k_heads % tp_size:
            raise ValueError(f"the gated DeltaNet's linear_num_key_heads {num_k_heads} do not split over {tp_size} "
                             "tensor-parallel ranks; choose a tp that divides them")
        local_k, local_v = num_k_heads // tp_size, num_v_heads // tp_size
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = local_k, local_v, k_head_dim, v_head_dim
        self.kernel = conv_kernel
        self.conv_dim = 2 * local_k * k_head_dim + local_v * v_head_dim
        qkvz = 2 * num_k_heads * k_head_dim + 2 * num_v_heads * v_head_dim
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        self.in_proj_qkvz = ColumnParallelLinear(in_features=hidden_size, out_features=qkvz, dtype=dtype, **tp)
        self.in_proj_ba = ColumnParallelLinear(in_features=hidden_size, out_features=2 * num_v_heads, dtype=dtype, **tp)
        key_width = num_k_heads * k_head_dim
        self.conv1d = CausalConv1d(segments=(key_width, key_width, num_v_heads * v_head_dim), kernel=conv_kernel,
                                   bias=False, dtype=dtype, **tp)
        self.dt_bias = new_param(local_v, dtype=dtype, shard=(0, tp_rank, tp_size))
        self.A_log = new_param(local_v, dtype=dtype, shard=(0, tp_rank, tp_size))
        self.norm = GatedRMSNorm(hidden_size=v_head_dim, eps=rms_norm_eps, dtype=dtype)
        self.out_proj = RowParallelLinear(in_features=num_v_heads * v_head_dim, out_features=hidden_size, dtype=dtype, **tp)

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
        if cache is None:
            past = mixed.new_zeros(batch, self.conv_dim, self.kernel - 1)
            memory = mixed.new_zeros(batch, self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        else:
            past, memory = cache.start(positions)
        window = torch.cat((past.to(mixed.dtype), mixed), dim=-1)
        mixed = F.silu(self.conv1d(window.to(self.conv1d.weight.dtype))).to(hidden.dtype).transpose(1, 2)
        key_width = self.k_heads * self.k_dim
        q, k, v = mixed.split((key_width, key_width, self.v_heads * self.v_dim), dim=-1)
        ratio = self.v_heads // self.k_heads
        q = q.reshape(batch, seq, self.k_heads, self.k_dim).repeat_interleave(ratio, dim=2)
        k = k.reshape(batch, seq, self.k_heads, self.k_dim).repeat_interleave(ratio, dim=2)
        v = v.reshape(batch, seq, self.v_heads, self.v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        keep = cache is not None and cache.keeps(seq)
        if seq > CHUNK and not keep:
            out, memory, states = (*chunked_gated_delta_rule(q, k, v, g, beta, memory), None)
        else:
            out, memory, states = gated_delta_rule(q, k, v, g, beta, memory, keep_states=keep)
        if cache is not None:
            cache.update(window, memory, states)
        out = self.norm(out.to(hidden.dtype), z)
        return self.out_proj(out.reshape(batch, seq, -1))

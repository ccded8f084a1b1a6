"""Grouped-query attention with the per-family options of Qwen3-MoE, Mixtral, GLM-4 MoE, MiniMax-M2 and gpt-oss.

One class, options as constructor arguments: projection biases (`qkv_bias` for GLM, `qkv_bias` and
`o_bias` for gpt-oss), qk-norm per head (Qwen3, GLM `use_qk_norm`) or over the whole projection
(MiniMax-M2 `qk_norm_type: per_layer`), sinks and a sliding window (gpt-oss), and Qwen3-Next's gated
attention (`output_gate`: `q_proj` also yields one gate per head dim, the output is scaled by its sigmoid
before `o_proj`; its per-head q/k norms are zero-centred, `zero_centered_qk_norm`). How many dims rotate is
the width of the `cos`/`sin` the model passes in (partial rotary for GLM and MiniMax-M2). Under tensor parallelism the heads split over `tp_size` ranks; key/value heads split too, or
are replicated when there are fewer of them than ranks (each rank then holds the one its query heads use).
Submodules carry the checkpoint names: `q_proj k_proj v_proj o_proj q_norm k_norm sinks`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.kernels import rotary_cache
from runtime.ops.attention_core import attention
from runtime.ops.kv_cache import StaticCache
from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, new_param, split
from runtime.ops.norms import ProjectionRMSNorm, RMSNorm
from runtime.ops.rotary import apply_rotary

QK_NORMS = ("none", "head", "projection")


def kv_head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(chunk, chunks) of the key/value heads this rank holds: an even split, or one replicated head."""
    if num_kv_heads >= tp_size:
        split(num_kv_heads, tp_size, "num_key_value_heads")
        return tp_rank, tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated evenly over {tp_size} ranks")
    return tp_rank // (tp_size // num_kv_heads), num_kv_heads


class GQAttention(nn.Module):
    """`forward(hidden [B, S, H], positions [S], cos, sin, cache=None) -> [B, S, H]`."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        interleaved_rope: bool = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: str = "none",
        rms_norm_eps: float = 1e-6,
        sinks: bool = False,
        sliding_window: int | None = None,
        output_gate: bool = False,
        zero_centered_qk_norm: bool = False,
        softmax_scale: float | None = None,
        rotary: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.head_dim = head_dim
        self.interleaved_rope = interleaved_rope
        self.rotary = rotary   # False: no position rotation at all (Nemotron-H: its Mamba layers carry positions)
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.local_heads = split(num_heads, tp_size, "num_attention_heads")
        kv_shard = kv_head_shard(num_kv_heads, tp_rank, tp_size)
        self.local_kv_heads = num_kv_heads // kv_shard[1]

        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        self.output_gate = output_gate
        # With the gate, each head's rows are [query, gate]: a split by heads keeps pairs together.
        self.q_proj = ColumnParallelLinear(
            in_features=hidden_size, out_features=2 * q_out if output_gate else q_out, bias=qkv_bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype
        )
        self.k_proj = ColumnParallelLinear(
            in_features=hidden_size, out_features=kv_out, bias=qkv_bias, shard=kv_shard, dtype=dtype
        )
        self.v_proj = ColumnParallelLinear(
            in_features=hidden_size, out_features=kv_out, bias=qkv_bias, shard=kv_shard, dtype=dtype
        )
        self.o_proj = RowParallelLinear(
            in_features=q_out, out_features=hidden_size, bias=o_bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype
        )
        self.qk_norm = qk_norm
        if qk_norm == "head":
            norm = dict(hidden_size=head_dim, eps=rms_norm_eps, zero_centered=zero_centered_qk_norm, dtype=dtype)
            self.q_norm, self.k_norm = RMSNorm(**norm), RMSNorm(**norm)
        elif qk_norm == "projection":
            self.q_norm = ProjectionRMSNorm(
                hidden_size=q_out, eps=rms_norm_eps, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype
            )
            self.k_norm = ProjectionRMSNorm(
                hidden_size=kv_out, eps=rms_norm_eps, tp_size=tp_size, shard=kv_shard, dtype=dtype
            )
        # One learned logit per query head, split with the heads.
        self.sinks = new_param(self.local_heads, dtype=dtype, shard=(0, tp_rank, tp_size)) if sinks else None
        self.fuse_projections()

    def new_cache(
        self, *, batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> StaticCache:
        shape = (self.local_kv_heads, self.head_dim)
        return StaticCache(
            batch_size=batch_size, max_seq_len=max_seq_len, first_shape=shape, second_shape=shape,
            dtype=dtype, device=device,
        )

    def fuse_projections(self) -> None:
        """Concatenate q/k/v weights (and biases) into one tensor the three parameters then view, so a CUDA
        forward runs one GEMM (one GEMV at decode) for all three. Called at construction on CUDA and after a
        load (a build constructed on the meta device gets its parameters then); the checkpoint names stay
        `q_proj k_proj v_proj`. A later `.to()` gives the parameters new storage: the forward sees that
        (`_qkv`) and runs the three projections until this is called again."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weights = [p.weight for p in projections]
        if self._qkv() is not None or any(w.device.type != "cuda" for w in weights):
            return   # the CPU path runs the three projections: nothing to fuse there (nor on meta)
        if len({(w.device, w.dtype, w.shape[1]) for w in weights}) > 1:
            return
        fused = []
        for name in ("weight", "bias"):
            parts = [getattr(p, name) for p in projections]
            if any(t is None for t in parts):
                fused.append(None)
                continue
            whole = torch.cat([t.detach() for t in parts], dim=0)
            start = 0
            for t in parts:
                t.data = whole[start : start + t.shape[0]]
                start += t.shape[0]
            fused.append(whole)
        self._qkv_fused = (fused, self._qkv_pointers())

    def _qkv_pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() if t is not None else 0
                     for p in (self.q_proj, self.k_proj, self.v_proj) for t in (p.weight, p.bias))

    def _qkv(self) -> list | None:
        """`[weight, bias]` of the fused projection while the parameters still view it, else None."""
        fused = self.__dict__.get("_qkv_fused")
        if fused is None or fused[1] != self._qkv_pointers():
            return None
        return fused[0]

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        fused = self._qkv() if hidden.is_cuda else None
        q_rows = self.q_proj.weight.shape[0]
        kv_rows = self.k_proj.weight.shape[0]
        if fused is not None:
            qkv = F.linear(hidden, *fused)
            q, k, v = qkv.split((q_rows, kv_rows, kv_rows), dim=-1)
        else:
            qkv = None
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        gate = None
        if self.output_gate:
            gate = q.view(batch, seq, self.local_heads, 2 * self.head_dim)[..., self.head_dim :].reshape(batch, seq, -1)

        # Without a cache (a full forward) the keys and values go to fresh [B, H, S, D] buffers at slots
        # 0 .. S-1 instead, so that path also takes the one launch (4 fewer per layer than op by op).
        kv = cache if cache is not None or qkv is None else _Buffers(qkv, self.local_kv_heads, seq, self.head_dim)
        if qkv is not None and self._fused_cache_write(qkv, cos, kv):
            # Norms, rotary and the cache write in one launch (runtime.kernels.rotary_cache).
            q = rotary_cache.apply(
                qkv, positions if cache is not None else kv.positions, cos if self.rotary else None,
                sin if self.rotary else None,
                self.q_norm.weight if self.qk_norm == "head" else None,
                self.k_norm.weight if self.qk_norm == "head" else None,
                kv.first, kv.second, q_heads=self.local_heads, kv_heads=self.local_kv_heads,
                head_dim=self.head_dim, q_head_stride=(2 if self.output_gate else 1) * self.head_dim,
                k_offset=q_rows, v_offset=q_rows + kv_rows,
                **(dict(eps=self.q_norm.eps, multiply_in_fp32=self.q_norm.multiply_in_fp32,
                        zero_centered=self.q_norm.zero_centered) if self.qk_norm == "head" else {}),
            )
            k, v, k_positions = kv.first, kv.second, cache.positions if cache is not None else positions
        else:
            q, k, v, k_positions = self._unfused(q, k, v, positions, cos, sin, cache)
        out = attention(
            q, k, v, positions, k_positions, self.scale, self.sliding_window, self.sinks, self_keys=cache is None
        )
        out = out.reshape(batch, seq, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _fused_cache_write(self, qkv: torch.Tensor, cos: torch.Tensor, cache: StaticCache) -> bool:
        if self.qk_norm == "projection" or self.interleaved_rope or cache.packed is not None:
            return False
        if self.qk_norm == "head" and not (self.q_norm.weight.dtype == self.k_norm.weight.dtype == qkv.dtype
                                           and self.q_norm.eps == self.k_norm.eps):
            return False
        return rotary_cache.applies(qkv, cos if self.rotary else None, cache.first, cache.second)

    def _unfused(self, q, k, v, positions, cos, sin, cache):
        """Norms, rotary and the cache write op by op (the CPU path, and what the fused kernel reproduces)."""
        batch, seq = q.shape[:2]
        if self.output_gate:
            q = q.view(batch, seq, self.local_heads, 2 * self.head_dim)[..., : self.head_dim].reshape(batch, seq, -1)
        v = v.reshape(batch, seq, self.local_kv_heads, self.head_dim)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(batch, seq, self.local_heads, self.head_dim)
        k = k.reshape(batch, seq, self.local_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q = apply_rotary(q, cos, sin, self.interleaved_rope)
            k = apply_rotary(k, cos, sin, self.interleaved_rope)
        if cache is None:
            return q, k.transpose(1, 2), v.transpose(1, 2), positions
        k, v = cache.update(positions, k, v)
        return q, k, v, cache.positions


class _Buffers:
    """Keys and values of one cache-less forward, `[B, heads, S, dim]` each, filled at slots `positions`."""

    packed = None

    def __init__(self, qkv: torch.Tensor, heads: int, seq: int, dim: int) -> None:
        shape = (qkv.shape[0], heads, seq, dim)
        self.first, self.second = qkv.new_empty(shape), qkv.new_empty(shape)
        self.positions = torch.arange(seq, device=qkv.device)

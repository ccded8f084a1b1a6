"""The Mamba-2 mixer of hybrid families (Nemotron-H): a causal depthwise conv, a selective state-space scan, a gated grouped RMSNorm.

`in_proj` makes, per token, the gate `z` (heads x head_dim), the conv input `xBC` (x, then B and C for
`n_groups` groups of `state_size`) and one `dt` per head. `xBC` passes a causal depthwise conv of width
`conv_kernel` and SiLU; then per head `h <- exp(dt A) h + dt x B^T` and `y = h C + D x`, with
`dt = softplus(dt + dt_bias)` and `A = -exp(A_log)`, all in fp32. `dt` is unbounded: Mamba-2's `dt_limit`
`(0, inf)`, as vLLM and transformers >= 5.25 run these checkpoints (a config bounding it is refused where it
is read, registry/configs.py; `time_step_min` is where `dt_bias`'s initialisation starts). The output is RMS-normed in
`n_groups` groups after gating by `silu(z)`, and projected back by `out_proj`.

The scan runs in plain torch in one of two forms that sum the same terms in another order: token by
token (decode, short inputs, blocks whose per-token states are kept) or, for inputs longer than a chunk,
the chunked state-space-dual form (`chunked_scan`: within a chunk a masked matrix product, between
chunks one matrix product over the chunks' boundary states). For decode a layer keeps a `MambaState`:
the last `conv_kernel - 1` conv inputs and the SSM state, fixed-shaped and updated in place, so a decode
step captures in a CUDA graph. A forward through a state continues from it, except at position 0, where
it starts from zeros (so a reused decoder's prefill forgets the previous request without a host sync);
runtime/ops/recurrent.py keeps the states a speculative verify rolls back to. Parameter names are the
checkpoint's: `in_proj conv1d dt_bias A_log D norm out_proj`. Under tensor parallelism each rank runs
`1 / tp` of the heads and of the B/C groups (a group's heads are consecutive, so a rank's heads read only
its groups): its rows of the fused `in_proj` and channels of `conv1d` are one chunk of each segment
(z, x, B, C, dt), and `out_proj` sums the ranks.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.ops.linear import RowParallelLinear, new_param, split
from runtime.ops.recurrent import RecurrentCache

CHUNK = 128   # the chunked scan's chunk (Nemotron-H's chunk_size): longer inputs run chunked


class MambaState(RecurrentCache):
    """A layer's decode state: `conv [B, conv_dim, conv_kernel - 1]` (model dtype), `ssm [B, heads, head_dim, state_size]` (fp32)."""

    def __init__(self, *, batch_size: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int,
                 state_size: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        # The SSM state is fp32 whatever the model dtype, as transformers keeps it (mamba_ssm_cache_dtype):
        # it accumulates over the whole sequence.
        super().__init__(torch.zeros(batch_size, conv_dim, conv_kernel - 1, dtype=dtype, device=device),
                         torch.zeros(batch_size, num_heads, head_dim, state_size, dtype=torch.float32, device=device))

    @property
    def ssm(self) -> torch.Tensor:
        """The SSM state (the recurrent cache's `memory`), by transformers' name."""
        return self.memory


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """`[..., groups, N]` -> `[..., heads, N]`: each group serves `heads // groups` consecutive heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def scan(x, dt, a, b, c, ssm, keep_states: bool = False):
    """The selective scan token by token: `y [B, S, H, P]` (without the `D x` skip) and the final state for
    `x [B, S, H, P]`, step sizes `dt [B, S, H]`, `a [H]` (negative), `b, c [B, S, G, N]`, from
    `ssm [B, H, P, N]` (all fp32); with `keep_states`, also the state after each token `[S, B, H, P, N]`.

    Per token: `h <- exp(dt a) h + dt x b^T`, `y = h c`."""
    heads = x.shape[2]
    b, c = _per_head(b, heads), _per_head(c, heads)
    decay = torch.exp(dt * a)                                                       # [B, S, H]
    ys, states = [], []
    for t in range(x.shape[1]):
        update = (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]    # [B, H, P, N]
        ssm = ssm * decay[:, t, :, None, None] + update
        ys.append(torch.einsum("bhpn,bhn->bhp", ssm, c[:, t]))
        states.append(ssm)
    return torch.stack(ys, dim=1), ssm, (torch.stack(states) if keep_states else None)


def _by_chunk(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, S, *]` -> `[B, S / chunk, chunk, *]`, zero-padded to whole chunks (`dt = 0` leaves the state as it was)."""
    pad = (-x.shape[1]) % chunk
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def chunked_scan(x, dt, a, b, c, ssm, chunk: int = CHUNK):
    """`scan`'s outputs and final state, computed a chunk at a time (Mamba-2's state-space-dual form).

    With `L_t` the accumulated log decay `sum dt a` and `h0` the state before the chunk, the recurrence
    unrolls to `y_t = exp(L_t) h0 c_t + sum_{s<=t} exp(L_t - L_s) (c_t . b_s) dt_s x_s`: a masked matrix
    product within the chunk. Each chunk's own contribution to the state at its end,
    `sum_s exp(L_C - L_s) dt_s x_s b_s^T`, and the decay across whole chunks give every chunk's `h0` from
    the first one's in one more matrix product over the chunks."""
    seq, heads = x.shape[1], x.shape[2]
    xs = _by_chunk(dt[..., None] * x, chunk)                                        # [B, N, C, H, P]
    cum = _by_chunk(dt * a, chunk).permute(0, 3, 1, 2).cumsum(-1)                   # L_t: [B, H, N, C]
    b, c = _by_chunk(b, chunk), _by_chunk(c, chunk)                                 # [B, N, C, G, state]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    within = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]
    scores = torch.einsum("bntgd,bnsgd->bgnts", c, b).repeat_interleave(heads // b.shape[3], dim=1)  # c_t . b_s per head
    y = torch.einsum("bhnts,bnshp->bnthp", scores * within, xs)
    b, c = _per_head(b, heads), _per_head(c, heads)                                 # [B, N, C, H, state]
    to_end = (cum[..., -1:] - cum).exp()
    own = torch.einsum("bhns,bnshp,bnshd->bnhpd", to_end, xs, b)                   # each chunk's own end state
    # The state before chunk n (n = N: after the last) from the first one's and the chunks' own states.
    total = cum[..., -1].cumsum(-1)                                                 # [B, H, N]
    before = torch.cat((total.new_zeros(*total.shape[:2], 1), total), dim=-1)       # [B, H, N + 1]
    earlier = torch.ones(before.shape[-1], total.shape[-1], dtype=torch.bool, device=x.device).tril(-1)
    across = (before[..., :, None] - total[..., None, :]).masked_fill(~earlier, float("-inf")).exp()
    starts = torch.einsum("bhnm,bmhpd->bnhpd", across, own) + before.exp().transpose(1, 2)[..., None, None] * ssm[:, None]
    y = y + torch.einsum("bnhpd,bnthd->bnthp", starts[:, :-1], c) * cum.exp().permute(0, 2, 3, 1)[..., None]
    return y.flatten(1, 2)[:, :seq], starts[:, -1]


def _segmented(segments: tuple[int, ...], tp_rank: int, tp_size: int, *trailing: int, dtype):
    """A parameter holding this rank's chunk of each of the checkpoint's `segments` along dim 0."""
    local = sum(split(n, tp_size, "a fused Mamba-2 projection segment") for n in segments)
    return new_param(local, *trailing, dtype=dtype, shard=(0, tp_rank, tp_size, segments))


class SegmentedLinear(nn.Module):
    """`in_proj`: `y = x W^T (+ b)` whose output rows are consecutive `segments`, each split over the ranks."""

    def __init__(self, *, in_features: int, segments: tuple[int, ...], bias: bool, tp_rank: int, tp_size: int,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = _segmented(segments, tp_rank, tp_size, in_features, dtype=dtype)
        self.bias = _segmented(segments, tp_rank, tp_size, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class CausalConv1d(nn.Module):
    """`conv1d.weight [channels, 1, kernel]`, `conv1d.bias [channels]`: a depthwise conv over positions (this
    rank's chunk of each channel segment)."""

    def __init__(self, *, segments: tuple[int, ...], kernel: int, bias: bool, tp_rank: int, tp_size: int,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = _segmented(segments, tp_rank, tp_size, 1, kernel, dtype=dtype)
        self.bias = _segmented(segments, tp_rank, tp_size, dtype=dtype) if bias else None

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """`window [B, C, K - 1 + S]` (the `K - 1` inputs before the `S` new ones) -> `[B, C, S]`."""
        return F.conv1d(window, self.weight, self.bias, groups=window.shape[1])


class GatedGroupRMSNorm(nn.Module):
    """`norm.weight [inner]`: `y * silu(z)` RMS-normed within each of `groups` equal channel groups, then scaled (fp32)."""

    def __init__(self, *, size: int, groups: int, eps: float, dtype: torch.dtype | None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.groups, self.eps = groups, float(eps)
        self.weight = new_param(size, dtype=dtype, shard=(0, tp_rank, tp_size))   # `size`: this rank's groups

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        grouped = gated.view(*gated.shape[:-1], self.groups, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.flatten(-2) * self.weight.float()


class Mamba2Mixer(nn.Module):
    """`forward(hidden [B, S, H], positions [S], state=None) -> [B, S, H]`."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        norm_eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        if n_groups % tp_size:
            raise ValueError(f"the Mamba-2 mixer's n_groups {n_groups} do not split over {tp_size} tensor-parallel "
                             "ranks; choose a tp that divides them")
        heads, groups = num_heads // tp_size, n_groups // tp_size
        self.num_heads, self.head_dim, self.state_size, self.n_groups = heads, head_dim, state_size, groups
        self.conv_kernel = conv_kernel
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        inner, bc = num_heads * head_dim, n_groups * state_size
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        self.in_proj = SegmentedLinear(in_features=hidden_size, segments=(inner, inner, bc, bc, num_heads),
                                       bias=proj_bias, dtype=dtype, **tp)
        self.conv1d = CausalConv1d(segments=(inner, bc, bc), kernel=conv_kernel, bias=conv_bias, dtype=dtype, **tp)
        self.dt_bias = new_param(heads, dtype=dtype, shard=(0, tp_rank, tp_size))
        self.A_log = new_param(heads, dtype=dtype, shard=(0, tp_rank, tp_size))
        self.D = new_param(heads, dtype=dtype, shard=(0, tp_rank, tp_size))
        self.norm = GatedGroupRMSNorm(size=self.inner, groups=groups, eps=norm_eps, dtype=dtype, **tp)
        self.out_proj = RowParallelLinear(in_features=inner, out_features=hidden_size, bias=proj_bias, dtype=dtype, **tp)

    def new_cache(self, *, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                  device: torch.device | str | None = None) -> MambaState:
        return MambaState(batch_size=batch_size, conv_dim=self.conv_dim, conv_kernel=self.conv_kernel,
                          num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size,
                          dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, state: MambaState | None = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        z, xbc, dt = self.in_proj(hidden).split((self.inner, self.conv_dim, self.num_heads), dim=-1)
        xbc = xbc.transpose(1, 2)
        if state is None:
            history = xbc.new_zeros(batch, self.conv_dim, self.conv_kernel - 1)
            ssm = hidden.new_zeros(batch, self.num_heads, self.head_dim, self.state_size, dtype=torch.float32)
        else:
            history, ssm = state.start(positions)
        window = torch.cat((history.to(xbc.dtype), xbc), dim=-1)
        xbc = F.silu(self.conv1d(window)).transpose(1, 2)
        x, b, c = xbc.split((self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size), dim=-1)

        # fp32 scan: x [B, S, heads, P], b/c [B, S, groups, N] (each group serves heads // n_groups heads).
        x = x.float().view(batch, seq, self.num_heads, self.head_dim)
        b = b.float().view(batch, seq, self.n_groups, self.state_size)
        c = c.float().view(batch, seq, self.n_groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float())                                 # [B, S, heads]
        a = -torch.exp(self.A_log.float())
        keep = state is not None and state.keeps(seq)
        if seq > CHUNK and not keep:
            y, ssm, states = (*chunked_scan(x, dt, a, b, c, ssm), None)
        else:
            y, ssm, states = scan(x, dt, a, b, c, ssm, keep_states=keep)
        y = y + self.D.float()[:, None] * x                                                # [B, S, heads, P]
        if state is not None:
            state.update(window, ssm, states)
        return self.out_proj(self.norm(y.reshape(batch, seq, self.inner), z).to(hidden.dtype))

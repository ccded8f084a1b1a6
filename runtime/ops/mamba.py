"""The Mamba-2 mixer of hybrid families (Nemotron-H): a causal depthwise conv, a selective state-space scan, a gated grouped RMSNorm.

`in_proj` makes, per token, the gate `z` (heads x head_dim), the conv input `xBC` (x, then B and C for
`n_groups` groups of `state_size`) and one `dt` per head. `xBC` passes a causal depthwise conv of width
`conv_kernel` and SiLU; then per head `h <- exp(dt A) h + dt x B^T` and `y = h C + D x`, with
`dt = max(softplus(dt + dt_bias), time_step_min)` and `A = -exp(A_log)`, all in fp32. The output is
RMS-normed in `n_groups` groups after gating by `silu(z)`, and projected back by `out_proj`.

The scan is sequential over positions in plain torch (exact, not fast: a chunked or fused scan is a
later kernel). For decode a layer keeps a `MambaState`: the last `conv_kernel - 1` conv inputs and the
SSM state, fixed-shaped and updated in place, so a decode step captures in a CUDA graph. A forward
through a state continues from it, except at position 0, where it starts from zeros (so a reused
decoder's prefill forgets the previous request without a host sync). Parameter names are the
checkpoint's: `in_proj conv1d dt_bias A_log D norm out_proj`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, new_param


class MambaState:
    """A layer's decode state: `conv [B, conv_dim, conv_kernel - 1]` (model dtype), `ssm [B, heads, head_dim, state_size]` (fp32)."""

    def __init__(self, *, batch_size: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int,
                 state_size: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        self.conv = torch.zeros(batch_size, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        # fp32 whatever the model dtype, as transformers keeps it (mamba_ssm_cache_dtype): the state
        # accumulates over the whole sequence.
        self.ssm = torch.zeros(batch_size, num_heads, head_dim, state_size, dtype=torch.float32, device=device)

    @property
    def advanced_in_place(self) -> tuple[torch.Tensor, ...]:
        """What a step updates from its old value (not a slot at its position): a graph's warm-up must undo it."""
        return (self.conv, self.ssm)


class CausalConv1d(nn.Module):
    """`conv1d.weight [channels, 1, kernel]`, `conv1d.bias [channels]`: a depthwise conv over positions."""

    def __init__(self, *, channels: int, kernel: int, bias: bool, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = new_param(channels, 1, kernel, dtype=dtype)
        self.bias = new_param(channels, dtype=dtype) if bias else None

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """`window [B, C, K - 1 + S]` (the `K - 1` inputs before the `S` new ones) -> `[B, C, S]`."""
        return F.conv1d(window, self.weight, self.bias, groups=window.shape[1])


class GatedGroupRMSNorm(nn.Module):
    """`norm.weight [inner]`: `y * silu(z)` RMS-normed within each of `groups` equal channel groups, then scaled (fp32)."""

    def __init__(self, *, size: int, groups: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.groups, self.eps = groups, float(eps)
        self.weight = new_param(size, dtype=dtype)

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
        time_step_min: float,
        norm_eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if tp_size != 1:
            raise ValueError(f"the Mamba-2 mixer runs unsplit: build it with tp_size 1, not {tp_size}")
        if num_heads % n_groups:
            raise ValueError(f"mamba_num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.conv_kernel, self.time_step_min = conv_kernel, float(time_step_min)
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.in_proj = ColumnParallelLinear(
            in_features=hidden_size, out_features=self.inner + self.conv_dim + num_heads, bias=proj_bias, dtype=dtype
        )
        self.conv1d = CausalConv1d(channels=self.conv_dim, kernel=conv_kernel, bias=conv_bias, dtype=dtype)
        self.dt_bias = new_param(num_heads, dtype=dtype)
        self.A_log = new_param(num_heads, dtype=dtype)
        self.D = new_param(num_heads, dtype=dtype)
        self.norm = GatedGroupRMSNorm(size=self.inner, groups=n_groups, eps=norm_eps, dtype=dtype)
        self.out_proj = RowParallelLinear(in_features=self.inner, out_features=hidden_size, bias=proj_bias, dtype=dtype)

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
            # Zero at position 0 (a new request), else continue; a multiply keeps it on the device.
            fresh = (positions[:1] > 0).to(state.ssm.dtype)
            history = state.conv * fresh.to(state.conv.dtype)
            ssm = state.ssm * fresh
        window = torch.cat((history.to(xbc.dtype), xbc), dim=-1)
        xbc = F.silu(self.conv1d(window)).transpose(1, 2)
        x, b, c = xbc.split((self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size), dim=-1)

        # fp32 scan: x [B, S, heads, P], b/c [B, S, heads, N] (each group serves heads // n_groups heads).
        per_group = self.num_heads // self.n_groups
        x = x.float().view(batch, seq, self.num_heads, self.head_dim)
        b = b.float().view(batch, seq, self.n_groups, 1, self.state_size).expand(-1, -1, -1, per_group, -1)
        c = c.float().view(batch, seq, self.n_groups, 1, self.state_size).expand(-1, -1, -1, per_group, -1)
        b = b.reshape(batch, seq, self.num_heads, self.state_size)
        c = c.reshape(batch, seq, self.num_heads, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.time_step_min)   # [B, S, heads]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))                             # [B, S, heads]
        ys = []
        for t in range(seq):
            update = (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]        # [B, heads, P, N]
            ssm = ssm * decay[:, t, :, None, None] + update
            ys.append(torch.einsum("bhpn,bhn->bhp", ssm, c[:, t]))
        y = torch.stack(ys, dim=1) + self.D.float()[:, None] * x                          # [B, S, heads, P]

        if state is not None:
            state.conv.copy_(window[..., window.shape[-1] - (self.conv_kernel - 1):])
            state.ssm.copy_(ssm)
        return self.out_proj(self.norm(y.reshape(batch, seq, self.inner), z).to(hidden.dtype))

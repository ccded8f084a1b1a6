"""The MLP of dense layers and shared experts (SiLU-gated, or Nemotron-H's non-gated relu²) and the Qwen-style sigmoid gate of a shared expert.

Every family here uses the same gated MLP outside its routed experts: `down(silu(gate(x)) * up(x))`. The
dense first layers of DeepSeek/GLM (`mlp`), DeepSeek/GLM shared experts (`shared_experts`, intermediate
= `moe_intermediate_size * n_shared_experts`) and Qwen2-MoE/Qwen3-Next shared experts (`shared_expert`,
scaled per token by `sigmoid(shared_expert_gate(x))`) are all this module with a different width.
Nemotron-H's dense and shared-expert MLPs are `down(relu(up(x))²)`, no gate (`activation="relu2"`).
Under TP the intermediate dimension splits (gate/up by rows, down by columns).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.activations import relu2
from runtime.ops.linear import ColumnParallelLinear, RowParallelLinear, new_param


class MLP(nn.Module):
    """`gate_proj` (not for relu2), `up_proj`, `down_proj`, no biases. `reduce_output=False` leaves the TP partial
    sum to the caller: shared experts inside an `MoEBlock` must be built that way (the block reduces once)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_output: bool = True,
        activation: str = "silu_glu",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("silu_glu", "relu2"):
            raise ValueError(f"an MLP's activation is silu_glu or relu2, got {activation!r}")
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        self.activation = activation
        if activation == "silu_glu":
            self.gate_proj = ColumnParallelLinear(in_features=hidden_size, out_features=intermediate_size, dtype=dtype, **tp)
        self.up_proj = ColumnParallelLinear(in_features=hidden_size, out_features=intermediate_size, dtype=dtype, **tp)
        self.down_proj = RowParallelLinear(
            in_features=intermediate_size, out_features=hidden_size, reduce=reduce_output, dtype=dtype, **tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu2":
            return self.down_proj(relu2(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SharedExpertGate(nn.Module):
    """`shared_expert_gate`: `sigmoid(x w^T)` with `weight [1, H]`, one scalar per token (replicated under TP)."""

    def __init__(self, *, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = new_param(1, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))

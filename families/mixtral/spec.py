"""Mixtral: every layer MoE (`block_sparse_moe`, experts w1/w3/w2), softmax top-k routing with renormalization, GQA with an optional window."""

from __future__ import annotations

from dataclasses import replace

from families.base import BASE_KEYS, RUNTIME_KEYS, Config, default, every_layer, keys, no_check, required
from families.qwen3_moe.spec import SPEC as QWEN3_MOE

# The layout of the families whose experts are `num_local_experts` of `intermediate_size` in every layer.
LOCAL_EXPERTS_KEYS = {
    "intermediate_size": required("dim"),
    "num_local_experts": required("dim"),
}


def sliding_windows(c: Config) -> tuple:
    return (c["sliding_window"],) * c["num_hidden_layers"]


SPEC = replace(
    QWEN3_MOE,
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, LOCAL_EXPERTS_KEYS, {
        "head_dim": default("dim", None, nullable=True),            # null: hidden_size // num_attention_heads
        "sliding_window": default("dim", None, nullable=True),
        "num_key_value_heads": default("dim", 8),
        "rms_norm_eps": default("eps", 1e-5),
        "rope_theta": default("positive", 1000000.0),
    }),
    moe_layers=every_layer,
    experts_key="num_local_experts",
    intermediate_key="intermediate_size",
    check=no_check,
    experts_prefix="model.layers.{layer}.block_sparse_moe.experts",
    expert_members=("0.w1", "0.w2", "0.w3"),
    published_names={},
    mlp_attr="block_sparse_moe",
    experts_storage="w1_w3_w2",
    sliding_windows=sliding_windows,
)

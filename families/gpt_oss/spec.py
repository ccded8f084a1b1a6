"""gpt-oss: every layer MoE with biased experts (clamped SwiGLU), a biased linear top-k router, GQA with sinks alternating sliding and full attention."""

from __future__ import annotations

from families.base import BASE_KEYS, RUNTIME_KEYS, Config, FamilySpec, default, every_layer, keys, optional, per_layer
from families.mixtral.spec import LOCAL_EXPERTS_KEYS


def sliding_windows(c: Config) -> tuple:
    # gpt-oss alternates sliding and full attention, starting with sliding, unless layer_types says.
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return tuple(c["sliding_window"] if t == "sliding_attention" else None for t in types)


def check(c: Config) -> None:
    per_layer(c, "layer_types")


SPEC = FamilySpec(
    name="gpt_oss",
    runtime=True,
    architectures=("GptOssForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, LOCAL_EXPERTS_KEYS, {
        "head_dim": default("dim", 64),
        "attention_bias": default("bool", True),
        "sliding_window": default("dim", 128),
        "layer_types": optional("layer_types"),      # absent: sliding and full attention alternate
        "swiglu_limit": default("positive", 7.0),
        "swiglu_alpha": default("positive", 1.702),   # transformers >= 5.25 reads it (5.17 fixed 1.702)
        "num_key_value_heads": default("dim", 8),
        "rms_norm_eps": default("eps", 1e-5),
        "rope_theta": default("positive", 150000.0),
        "rope_scaling": default("rope", dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                             original_max_position_embeddings=4096), nullable=True),
    }),
    moe_layers=every_layer,
    experts_key="num_local_experts",
    intermediate_key="intermediate_size",
    activation="swiglu_oai",
    expert_bias=True,
    check=check,
    expert_members=("gate_up_proj", "down_proj"),
    router="LinearTopKSoftmaxRouter",
    # One fused tensor per projection: the hub's MXFP4 blocks/scales, or what transformers saves for bf16.
    experts_storage="fused_gate_up",
    sliding_windows=sliding_windows,
)

"""GLM-4 MoE: DeepSeek-V3's MoE layout and MTP layers with GQA attention (optional per-head q/k norm, partial rotary)."""

from __future__ import annotations

from dataclasses import replace

from families.base import BASE_KEYS, RUNTIME_KEYS, default, describe_gqa, gqa_head_dim, keys
from families.deepseek_v3.spec import MOE_KEYS, SPEC as DEEPSEEK_V3

SPEC = replace(
    DEEPSEEK_V3,
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, MOE_KEYS, {
        "num_key_value_heads": default("dim", 8),
        "partial_rotary_factor": default("fraction", 0.5),
        "use_qk_norm": default("bool", False),
        "n_group": default("dim", 1),
        "topk_group": default("dim", 1),
        "routed_scaling_factor": default("positive", 1.0),
        "rms_norm_eps": default("eps", 1e-5),
        "rope_theta": default("positive", 10000.0),
    }),
    attention_ops=("GQAttention",),
    head_dim=gqa_head_dim,
    stores_head_dim=True,
    describe_attention=describe_gqa,
)

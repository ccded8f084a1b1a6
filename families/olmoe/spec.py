"""OLMoE: every layer MoE (softmax top-k, `norm_topk_prob`), GQA whose q and k are RMS-normed over each whole projection: Qwen3-MoE's build with MiniMax-M2's q/k norm."""

from __future__ import annotations

from dataclasses import replace

from families.base import (BASE_KEYS, RUNTIME_KEYS, Config, ConfigError, default, every_layer, full_attention, keys,
                           optional, required, template)
from families.qwen3_moe.spec import SPEC as QWEN3_MOE


def check(c: Config) -> None:
    # transformers' q_norm spans hidden_size: the heads must tile it exactly.
    heads, head_dim = c["num_attention_heads"], c["head_dim"]
    if heads is not None and head_dim is not None and heads * head_dim != c["hidden_size"]:
        raise ConfigError(("head_dim",), f"head_dim {head_dim} times num_attention_heads {heads} must equal hidden_size "
                               f"{c['hidden_size']} (OLMoE normalizes q over hidden_size); leave head_dim out")


SPEC = replace(
    QWEN3_MOE,
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, {
        "intermediate_size": required("dim"),
        "num_experts": required("dim"),
        # transformers reads null as num_attention_heads; a declaration states it.
        "num_key_value_heads": template("dim"),
        "norm_topk_prob": default("bool", False),
        "attention_bias": default("bool", False),
        "clip_qkv": optional((None,)),          # the runtime clips nothing: only null (the published configs') builds
        "rms_norm_eps": default("eps", 1e-5),
        "rope_theta": default("positive", 10000.0),
    }),
    moe_layers=every_layer,
    experts_key="num_experts",
    intermediate_key="intermediate_size",
    check=check,
    sliding_windows=full_attention,
)

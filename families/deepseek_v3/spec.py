"""DeepSeek-V3: MLA attention, sigmoid group-limited routing, shared + routed experts after dense first layers, MTP layers after the main ones."""

from __future__ import annotations

from families.base import (BASE_KEYS, RUNTIME_KEYS, Config, ConfigError, FamilySpec, default, keys, optional, required,
                           template)

# DeepSeek-V3's MoE layout (GLM-4 MoE keeps it): dense layers first, sigmoid group-limited routing.
MOE_KEYS = {
    "moe_intermediate_size": required("dim"),
    "n_routed_experts": required("dim"),
    "first_k_dense_replace": required("index"),
    "intermediate_size": template("dim"),
    "moe_layer_freq": optional("dim"),
    "num_nextn_predict_layers": optional("count"),
    "n_shared_experts": default("dim", 1),
    "norm_topk_prob": default("bool", True),
    "attention_bias": default("bool", False),
}


def after_dense(config: Config) -> tuple[int, ...]:
    freq = config.get("moe_layer_freq", 1)
    first = config["first_k_dense_replace"]
    return tuple(i for i in range(config["num_hidden_layers"]) if i >= first and i % freq == 0)


def check_moe(c: Config) -> None:
    if c["first_k_dense_replace"] > c["num_hidden_layers"]:
        raise ConfigError(("first_k_dense_replace",), f"first_k_dense_replace {c['first_k_dense_replace']} exceeds "
                               f"num_hidden_layers {c['num_hidden_layers']}")
    experts, groups, topk_group = c["n_routed_experts"], c["n_group"], c["topk_group"]
    if experts % groups:
        raise ConfigError(("n_group",), f"n_group {groups} must divide n_routed_experts {experts}")
    if topk_group > groups:
        raise ConfigError(("topk_group",), f"topk_group {topk_group} exceeds n_group {groups}")
    reachable = topk_group * (experts // groups)
    if c["num_experts_per_tok"] > reachable:
        raise ConfigError(("num_experts_per_tok",), f"num_experts_per_tok {c['num_experts_per_tok']} exceeds the "
                               f"{reachable} experts of the topk_group {topk_group} groups a token may pick from")


def describe_mla(c: Config, rotary: str, base) -> tuple[str, str]:
    return f"MLA attention, {c['num_attention_heads']} heads", f"{rotary} on the {c['rope']['rotary_dim']} rope dims (base {base})"


SPEC = FamilySpec(
    name="deepseek_v3",
    runtime=True,
    architectures=("DeepseekV3ForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, MOE_KEYS, {
        "q_lora_rank": default("dim", 1536, nullable=True),   # null: queries straight from the hidden state (V2-Lite style)
        "kv_lora_rank": template("dim"),
        "qk_nope_head_dim": template("dim"),
        "qk_rope_head_dim": template("dim"),
        "v_head_dim": template("dim"),
        "n_group": default("dim", 8),
        "topk_group": default("dim", 4),
        "routed_scaling_factor": default("positive", 2.5),
        "rms_norm_eps": default("eps", 1e-6),
        "rope_theta": default("positive", 10000.0),
        "rope_interleave": default("bool", True),
    }),
    moe_layers=after_dense,
    experts_key="n_routed_experts",
    intermediate_key="moe_intermediate_size",
    check=check_moe,
    draft_experts_prefix="model.layers.{layer}.mlp.experts",
    draft_count_key="num_nextn_predict_layers",
    router="SigmoidTopKRouter",
    attention_ops=("MLAttention", "mla_softmax_scale"),
    shared_experts=True,
    # MLA rotates only its qk_rope_head_dim part of each head.
    head_dim=lambda c: c["qk_rope_head_dim"],
    stores_head_dim=False,
    describe_attention=describe_mla,
    mtp_draft=True,
)

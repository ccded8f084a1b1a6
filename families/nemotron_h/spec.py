"""Nemotron-H: a hybrid stack laid out by `hybrid_override_pattern` (Mamba-2 mixers, attention without rotary, relu² MoE and MLP layers), one norm and one mixer per layer."""

from __future__ import annotations

from families.base import (BASE_KEYS, RUNTIME_KEYS, Config, ConfigError, FamilySpec, default, keys, optional,
                           per_layer, required, template, unbuilt)


def pattern(config: Config) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config["hybrid_override_pattern"]) if kind == "E")


def mtp_moe_sites(config: Config) -> tuple[int, ...]:
    """The MoE layers of the MTP step, by their index under `mtp.layers.` (vLLM nemotron_h_mtp.py: one layer per
    letter of mtp_hybrid_override_pattern, `*E` in the published configs)."""
    return tuple(i for i, kind in enumerate(config["mtp_hybrid_override_pattern"]) if kind == "E")


def check(c: Config) -> None:
    per_layer(c, "hybrid_override_pattern")
    mtp = c.get("mtp_hybrid_override_pattern")
    if c.get("num_nextn_predict_layers") and mtp is not None and set(mtp) - set("*E"):
        raise ConfigError(("mtp_hybrid_override_pattern",), f"mtp_hybrid_override_pattern {mtp!r} may hold only '*' "
                                                            "(attention) and 'E' (MoE) layers, as vLLM's Nemotron-H MTP builds")
    if (c.get("num_nextn_predict_layers") or 0) > 1:
        raise ConfigError(("num_nextn_predict_layers",), f"num_nextn_predict_layers {c['num_nextn_predict_layers']}: "
                                                         "a Nemotron-H MTP is one step of mtp_hybrid_override_pattern (set 1)")
    heads, groups = c.get("mamba_num_heads"), c.get("n_groups")
    if heads is not None and groups is not None and heads % groups:
        raise ConfigError(("n_groups",), f"mamba_num_heads {heads} must be a multiple of n_groups {groups}")


# transformers >= 5 writes the layout as block type names; the published configs as one letter per layer.
BLOCK_LETTERS = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}


def published_form(config: Config) -> Config:
    """`layers_block_type` (as transformers 5 saves it) as `hybrid_override_pattern` and `num_hidden_layers`."""
    blocks = config.get("layers_block_type")
    if "hybrid_override_pattern" in config or not isinstance(blocks, list):
        return config
    out = {k: v for k, v in config.items() if k not in ("layers_block_type", "mtp_layers_block_type")}
    # An unknown block name stays visible: the pattern's own check refuses it, naming the key.
    out["hybrid_override_pattern"] = letters(blocks)
    out["num_hidden_layers"] = len(blocks)
    if isinstance(config.get("mtp_layers_block_type"), list) and out.get("num_nextn_predict_layers"):
        out["mtp_hybrid_override_pattern"] = letters(config["mtp_layers_block_type"])
    return out


def letters(blocks: list) -> str:
    return "".join(BLOCK_LETTERS.get(b, "?") if isinstance(b, str) else "?" for b in blocks)


def no_rotary_head_dim(c: Config) -> int:
    return c["head_dim"]


def describe_attention(c: Config, rotary: str, base) -> tuple[str, str]:
    mamba = f"Mamba-2 mixers of {c['mamba_num_heads']} heads of {c['mamba_head_dim']} (state {c['ssm_state_size']})"
    attention = (f"{mamba}; GQA attention, {c['num_attention_heads']} query / {c['num_key_value_heads']} key-value "
                 f"heads of {c['head_dim']}")
    return attention, "no rotary (the Mamba layers carry positions)"


SPEC = FamilySpec(
    name="nemotron_h",
    runtime=True,
    architectures=("NemotronHForCausalLM",),
    keys=keys(BASE_KEYS, {"tie_word_embeddings": RUNTIME_KEYS["tie_word_embeddings"]}, {
        "moe_intermediate_size": required("dim"),
        "n_routed_experts": required("dim"),
        # One letter per layer: M Mamba, * attention, - MLP, E MoE.
        "hybrid_override_pattern": required("layer_pattern"),
        "moe_shared_expert_intermediate_size": default("dim", 7688),
        "n_shared_experts": default("dim", 1),
        "intermediate_size": default("dim", 21504),         # the `-` layers' MLP
        "num_nextn_predict_layers": optional("count"),
        # The MTP step's layers, one letter each (transformers' default ['full_attention', 'moe']).
        "mtp_hybrid_override_pattern": default("draft_pattern", "*E"),
        "mlp_hidden_act": default(("relu2",), "relu2"),
        "mamba_hidden_act": default(("silu",), "silu"),
        "num_key_value_heads": default("dim", 8),
        "head_dim": default("dim", 128),
        "mamba_num_heads": default("dim", 128),
        "mamba_head_dim": default("dim", 64),
        "ssm_state_size": default("dim", 128),
        "n_groups": default("dim", 8),
        "conv_kernel": default("dim", 4),
        "chunk_size": unbuilt("dim"),                       # transformers' chunked scan; the runtime's scan reads no chunks
        "use_conv_bias": default("bool", True),
        "use_bias": default((False,), False),               # the Mamba projections' bias: none in any release
        "mlp_bias": default((False,), False),
        "attention_bias": default((False,), False),
        "moe_latent_size": default((None,), None, nullable=True),   # latent experts projection: not built
        "time_step_limit": optional("unbounded_limit"),    # Mamba-2's dt bound: only (0, inf) is built
        "layer_norm_epsilon": default("eps", 1e-5),
        "n_group": default("dim", 1),
        "topk_group": default("dim", 1),
        "norm_topk_prob": default("bool", True),
        "routed_scaling_factor": default("positive", 1.0),
        "residual_in_fp32": default((False,), False),
        "num_attention_heads": template("dim"),
    }),
    moe_layers=pattern,
    experts_key="n_routed_experts",
    intermediate_key="moe_intermediate_size",
    activation="relu2",
    check=check,
    experts_prefix="backbone.layers.{layer}.mixer.experts",
    # vLLM nemotron_h_mtp.py (NemotronHMultiTokenPredictor): `mtp.layers.<i>` per letter of the MTP pattern, the
    # first with enorm/hnorm/eh_proj, the last with final_layernorm; "{k}" is the MoE layer's index there.
    draft_experts_prefix="mtp.layers.{k}.mixer.experts",
    draft_moe_sites=mtp_moe_sites,
    draft_count_key="num_nextn_predict_layers",
    expert_members=("0.up_proj", "0.down_proj"),
    published_form=published_form,
    router="SigmoidTopKRouter",
    attention_ops=("GQAttention", "Mamba2Mixer"),
    mlp_attr="mixer",
    backbone_names=("backbone", "embeddings", "norm_f"),
    shared_experts=True,
    head_dim=no_rotary_head_dim,
    mtp_draft=True,
    mtp_tree="mtp",
    mtp_predictor="PatternMTPPredictor",
    describe_attention=describe_attention,
)

"""Qwen3-Next: hybrid layers (gated DeltaNet linear attention, gated full attention every `full_attention_interval`-th), Qwen3-MoE's sparse-step MoE with a sigmoid-gated shared expert, MTP layers under `mtp.`."""

from __future__ import annotations

from families.base import (BASE_KEYS, RUNTIME_KEYS, Config, ConfigError, FamilySpec, default, keys, optional,
                           per_layer, required)
from families.qwen3_moe.spec import SPARSE_STEP_KEYS, check_sparse_step, sparse_step

FULL_ATTENTION_INTERVAL = 4   # transformers' default when neither layer_types nor the interval is given


def mixer_types(c: Config) -> list[str]:
    """Each layer's token mixer, as transformers derives it: `layer_types`, else full attention every interval-th layer."""
    interval = c.get("full_attention_interval") or FULL_ATTENTION_INTERVAL
    return c.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(c["num_hidden_layers"])
    ]


def attention_layers(c: Config) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(mixer_types(c)) if kind == "full_attention")


def check(c: Config) -> None:
    check_sparse_step(c)
    per_layer(c, "layer_types")
    heads, k_heads = c.get("linear_num_value_heads"), c.get("linear_num_key_heads")
    if heads and k_heads and heads % k_heads:
        raise ConfigError(("linear_num_value_heads",), f"linear_num_value_heads {heads} must be a multiple of "
                                                       f"linear_num_key_heads {k_heads} (each key head serves whole value heads)")
    dense = [i for i in range(c["num_hidden_layers"]) if i not in sparse_step(c)]
    if dense and c.get("intermediate_size") is None:
        raise ConfigError(("intermediate_size",), f"layers {dense[:8]} are dense MLPs (mlp_only_layers, decoder_sparse_step): "
                                                  "state their intermediate_size")


def describe(c: Config, rotary: str, base) -> tuple[str, str]:
    full = c["attention_layers"]   # normalized: the raw keys it came from are folded away
    linear = c["num_hidden_layers"] - len(full)
    dims = {c["linear_key_head_dim"], c["linear_value_head_dim"]}
    linear_dims = "/".join(str(d) for d in (c["linear_key_head_dim"], c["linear_value_head_dim"])) if len(dims) > 1 else str(*dims)
    attention = (f"gated DeltaNet attention, {linear} layer{'s' if linear != 1 else ''} of {c['linear_num_key_heads']} key / {c['linear_num_value_heads']} "
                 f"value heads of {linear_dims}; gated GQA, {len(full)} of {c['num_attention_heads']} query / "
                 f"{c['num_key_value_heads']} kv heads of {c['head_dim']}")
    return attention, f"{rotary} on {c['rope']['rotary_dim']} of {c['head_dim']} dims (base {base})"


SPEC = FamilySpec(
    name="qwen3_next",
    runtime=True,
    architectures=("Qwen3NextForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, SPARSE_STEP_KEYS, {
        "decoder_sparse_step": default("dim", 1),
        "mlp_only_layers": default("indices", [], nullable=True),   # null: none (transformers reads null as [])
        "shared_expert_intermediate_size": default("dim", 512),
        "norm_topk_prob": default("bool", True),
        "attention_bias": default("bool", False),
        "num_key_value_heads": default("dim", 2),
        "head_dim": default("dim", 256),
        "rms_norm_eps": default("eps", 1e-6),
        "rope_theta": default("positive", 10000.0),
        "partial_rotary_factor": default("fraction", 0.25),
        "linear_conv_kernel_dim": default("dim", 4),
        "linear_key_head_dim": default("dim", 128),
        "linear_value_head_dim": default("dim", 128),
        "linear_num_key_heads": default("dim", 16),
        "linear_num_value_heads": default("dim", 32),
        "layer_types": optional("mixer_types"),
        "full_attention_interval": optional("dim"),   # read by the config class only when layer_types is absent
        "mtp_num_hidden_layers": optional("count"),
        "num_experts": required("dim"),
    }),
    moe_layers=sparse_step,
    experts_key="num_experts",
    intermediate_key="moe_intermediate_size",
    check=check,
    # vLLM qwen3_next_mtp.py (Qwen3NextMultiTokenPredictor): `mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`,
    # `mtp.layers.<k>` (full-attention decoder layers with the MoE block), `mtp.norm`.
    draft_experts_prefix="mtp.layers.{k}.mlp.experts",
    draft_count_key="mtp_num_hidden_layers",
    router="SoftmaxTopKRouter",
    # The ops module names its build imports beyond the shared ones: the linear mixer, the shared expert and its gate.
    attention_ops=("GQAttention", "GatedDeltaNet", "MLP", "SharedExpertGate"),
    attention_layers=attention_layers,
    describe_attention=describe,
    mtp_draft=True,
    mtp_tree="mtp",
    mtp_predictor="FcMTPPredictor",
)

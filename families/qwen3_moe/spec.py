"""Qwen3-MoE: every `decoder_sparse_step`-th layer MoE (except `mlp_only_layers`), softmax top-k routing, GQA with per-head q/k norm."""

from __future__ import annotations

from families.base import BASE_KEYS, RUNTIME_KEYS, Config, FamilySpec, default, keys, layer_list, optional, required

# Qwen's layout: every `decoder_sparse_step`-th layer is MoE, except those `mlp_only_layers` names.
SPARSE_STEP_KEYS = {
    "moe_intermediate_size": required("dim"),
    "num_experts": required("dim"),
    "intermediate_size": optional("dim"),            # the dense layers' MLP, when there are any
    "decoder_sparse_step": optional("dim"),
    "mlp_only_layers": optional("indices"),
}


def sparse_step(config: Config) -> tuple[int, ...]:
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def check_sparse_step(c: Config) -> None:
    layer_list(c, "mlp_only_layers")


def sliding_windows(c: Config) -> tuple:
    # The class default window applies only under use_sliding_window (off by default).
    return (c["sliding_window"] if c["use_sliding_window"] else None,) * c["num_hidden_layers"]


SPEC = FamilySpec(
    name="qwen3_moe",
    runtime=True,
    architectures=("Qwen3MoeForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, SPARSE_STEP_KEYS, {
        "decoder_sparse_step": default("dim", 1),
        "mlp_only_layers": default("indices", [], nullable=True),   # null: none (transformers reads null as [])
        "sliding_window": default("dim", 4096, nullable=True),
        "use_sliding_window": default("bool", False),
        "norm_topk_prob": default("bool", False),
        "attention_bias": default("bool", False),
        "num_key_value_heads": default("dim", 4),
        "rms_norm_eps": default("eps", 1e-6),
        "rope_theta": default("positive", 10000.0),
    }),
    moe_layers=sparse_step,
    experts_key="num_experts",
    intermediate_key="moe_intermediate_size",
    check=check_sparse_step,
    published_names={"num_local_experts": "num_experts"},
    router="SoftmaxTopKRouter",
    sliding_windows=sliding_windows,
)

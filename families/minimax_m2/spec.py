"""MiniMax-M2: every layer MoE (`block_sparse_moe`, experts w1/w3/w2), a sigmoid router with its bias on the block, GQA with q/k norm over the projection."""

from __future__ import annotations

from families.base import (BASE_KEYS, RUNTIME_KEYS, Config, ConfigError, FamilySpec, default, every_layer, keys,
                           optional)
from families.mixtral.spec import LOCAL_EXPERTS_KEYS


def check(c: Config) -> None:
    if c["rotary_dim"] is not None and c["rotary_dim"] > c["head_dim"]:
        raise ConfigError(("rotary_dim",), f"rotary_dim {c['rotary_dim']} exceeds head_dim {c['head_dim']}")


def rotary_factor(config: Config, defaults: Config) -> float | None:
    """The legacy `rotary_dim` as a partial rotary factor (transformers reads it so)."""
    if config.get("rotary_dim"):
        return config["rotary_dim"] / config.get("head_dim", defaults["head_dim"])
    return None


SPEC = FamilySpec(
    name="minimax_m2",
    runtime=True,
    architectures=("MiniMaxM2ForCausalLM",),
    keys=keys(BASE_KEYS, RUNTIME_KEYS, LOCAL_EXPERTS_KEYS, {
        "head_dim": default("dim", 128),
        "rotary_dim": optional("dim"),                  # legacy spelling of a partial rotary factor
        "use_qk_norm": optional("bool"),
        "num_mtp_modules": optional("count"),
        "num_key_value_heads": default("dim", 8),
        "rms_norm_eps": default("eps", 1e-6),
        "rope_theta": default("positive", 5000000.0),
    }),
    moe_layers=every_layer,
    experts_key="num_local_experts",
    intermediate_key="intermediate_size",
    check=check,
    experts_prefix="model.layers.{layer}.block_sparse_moe.experts",
    # MTP modules: one transformer layer each (research §2, num_mtp_modules). The module path is
    # assumed: the published checkpoints carry no MTP tensors at all (MiniMax-M2 issue #47,
    # MiniMax-M2.7 issue #16), so codegen builds no embedded MTP draft for this family.
    draft_experts_prefix="model.mtp_modules.{k}.block_sparse_moe.experts",
    draft_count_key="num_mtp_modules",
    expert_members=("0.w1", "0.w2", "0.w3"),
    router="SigmoidTopKRouter",
    mlp_attr="block_sparse_moe",
    experts_storage="w1_w3_w2",
    rotary_factor=rotary_factor,
    # MiniMax-AI/MiniMax-M2 issue #47, MiniMax-M2.7 issue #16 (0 of ~1369 tensors match mtp.*), MiniMax-M2.5
    # issue #8: the configs declare num_mtp_modules, the published checkpoints carry no MTP weights.
    mtp_refusal=("MiniMax-M2 checkpoints as published carry no MTP weights (their config's num_mtp_modules "
                 "notwithstanding)"),
)

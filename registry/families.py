"""Architecture families: where a family keeps its MoE layers and what each layer asks of an implementation.

Pure functions of a declaration's HF-style `config` table, typed and range-checked by
`registry.configs` before any of them reads it. `runtime` says whether the runtime can
build the family; a declaration of another family still resolves and explains (its layers are data),
but no build is generated for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from contract import MoeShape

Config = dict[str, Any]


@dataclass(frozen=True)
class FamilySpec:
    name: str
    runtime: bool
    architectures: tuple[str, ...]          # config.json "architectures" values it reads
    moe_layers: Callable[[Config], tuple[int, ...]]
    shape: Callable[[Config], MoeShape]
    experts_prefix: str = "model.layers.{layer}.mlp.experts"     # "{layer}" = decoder layer index
    draft_experts_prefix: str | None = None  # "{layer}" = absolute index, "{k}" = draft layer number
    expert_members: tuple[str, ...] = ("0.gate_proj", "0.up_proj", "0.down_proj")  # for exclusion patterns
    num_draft_layers: Callable[[Config], int] = lambda config: 0

    def experts_module(self, layer: int) -> str:
        return self.experts_prefix.format(layer=layer)

    def draft_experts_module(self, config: Config, k: int) -> str:
        assert self.draft_experts_prefix is not None
        return self.draft_experts_prefix.format(layer=config["num_hidden_layers"] + k, k=k)


def _every_layer(config: Config) -> tuple[int, ...]:
    return tuple(range(config["num_hidden_layers"]))


def _after_dense(config: Config) -> tuple[int, ...]:
    freq = config.get("moe_layer_freq", 1)
    first = config["first_k_dense_replace"]
    return tuple(i for i in range(config["num_hidden_layers"]) if i >= first and i % freq == 0)


def _sparse_step(config: Config) -> tuple[int, ...]:
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _pattern(config: Config) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config["hybrid_override_pattern"]) if kind == "E")


def _shape(experts: str, inter: str, activation: str = "silu_glu", bias: bool = False):
    def shape(config: Config) -> MoeShape:
        return MoeShape(
            hidden_size=config["hidden_size"],
            intermediate_size=config[inter],
            num_experts=config[experts],
            top_k=config["num_experts_per_tok"],
            activation=activation,
            expert_bias=bias,
        )

    return shape


def _key(name: str) -> Callable[[Config], int]:
    return lambda config: config.get(name, 0)


_W123 = ("0.w1", "0.w2", "0.w3")

_DEEPSEEK_V3 = FamilySpec(
    name="deepseek_v3",
    runtime=True,
    architectures=("DeepseekV3ForCausalLM",),
    draft_experts_prefix="model.layers.{layer}.mlp.experts",
    moe_layers=_after_dense,
    num_draft_layers=_key("num_nextn_predict_layers"),
    shape=_shape("n_routed_experts", "moe_intermediate_size"),
)

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        _DEEPSEEK_V3,
        # GLM-4 MoE keeps DeepSeek-V3's MoE layout and MTP layers; its attention is GQA.
        replace(
            _DEEPSEEK_V3,
            name="glm4_moe",
            architectures=("Glm4MoeForCausalLM",),
        ),
        FamilySpec(
            name="qwen3_moe",
            runtime=True,
            architectures=("Qwen3MoeForCausalLM",),
            moe_layers=_sparse_step,
            shape=_shape("num_experts", "moe_intermediate_size"),
        ),
        FamilySpec(
            name="mixtral",
            runtime=True,
            architectures=("MixtralForCausalLM",),
            experts_prefix="model.layers.{layer}.block_sparse_moe.experts",
            expert_members=_W123,
            moe_layers=_every_layer,
            shape=_shape("num_local_experts", "intermediate_size"),
        ),
        FamilySpec(
            name="gpt_oss",
            runtime=True,
            architectures=("GptOssForCausalLM",),
            expert_members=("gate_up_proj", "down_proj"),
            moe_layers=_every_layer,
            shape=_shape("num_local_experts", "intermediate_size", activation="swiglu_oai", bias=True),
        ),
        FamilySpec(
            name="minimax_m2",
            runtime=True,
            architectures=("MiniMaxM2ForCausalLM",),
            experts_prefix="model.layers.{layer}.block_sparse_moe.experts",
            # MTP modules: one transformer layer each (research §2, num_mtp_modules). The module path is
            # assumed: the published checkpoints carry no MTP tensors at all (MiniMax-M2 issue #47,
            # MiniMax-M2.7 issue #16), so codegen builds no embedded MTP draft for this family.
            draft_experts_prefix="model.mtp_modules.{k}.block_sparse_moe.experts",
            expert_members=_W123,
            moe_layers=_every_layer,
            num_draft_layers=_key("num_mtp_modules"),
            shape=_shape("num_local_experts", "intermediate_size"),
        ),
        FamilySpec(
            name="qwen3_next",
            runtime=False,
            architectures=("Qwen3NextForCausalLM",),
            draft_experts_prefix="mtp.layers.{k}.mlp.experts",
            moe_layers=_sparse_step,
            num_draft_layers=_key("mtp_num_hidden_layers"),
            shape=_shape("num_experts", "moe_intermediate_size"),
        ),
        FamilySpec(
            name="nemotron_h",
            runtime=False,
            architectures=("NemotronHForCausalLM",),
            experts_prefix="backbone.layers.{layer}.mixer.experts",
            draft_experts_prefix="mtp.layers.{k}.mixer.experts",
            expert_members=("0.up_proj", "0.down_proj"),
            moe_layers=_pattern,
            num_draft_layers=_key("num_nextn_predict_layers"),
            shape=_shape("n_routed_experts", "moe_intermediate_size", activation="relu2"),
        ),
    )
}

RUNTIME_FAMILIES = tuple(name for name, spec in FAMILIES.items() if spec.runtime)


def family_for_architecture(architecture: str) -> FamilySpec | None:
    return next((f for f in FAMILIES.values() if architecture in f.architectures), None)

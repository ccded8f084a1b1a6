"""Nemotron-H: a hybrid Mamba / attention / MoE stack laid out by `hybrid_override_pattern`, relu² experts (resolves and explains; the runtime does not build it yet)."""

from __future__ import annotations

from families.base import BASE_KEYS, Config, FamilySpec, keys, optional, per_layer, required


def pattern(config: Config) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config["hybrid_override_pattern"]) if kind == "E")


def check(c: Config) -> None:
    per_layer(c, "hybrid_override_pattern")


SPEC = FamilySpec(
    name="nemotron_h",
    runtime=False,
    architectures=("NemotronHForCausalLM",),
    keys=keys(BASE_KEYS, {
        "moe_intermediate_size": required("dim"),
        "n_routed_experts": required("dim"),
        # One letter per layer: M Mamba, * attention, - MLP, E MoE.
        "hybrid_override_pattern": required("layer_pattern"),
        "moe_shared_expert_intermediate_size": optional("dim"),
        "num_nextn_predict_layers": optional("count"),
        "mlp_hidden_act": optional(("relu2",)),
    }),
    moe_layers=pattern,
    experts_key="n_routed_experts",
    intermediate_key="moe_intermediate_size",
    activation="relu2",
    check=check,
    experts_prefix="backbone.layers.{layer}.mixer.experts",
    draft_experts_prefix="mtp.layers.{k}.mixer.experts",
    draft_count_key="num_nextn_predict_layers",
    expert_members=("0.up_proj", "0.down_proj"),
)

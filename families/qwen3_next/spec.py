"""Qwen3-Next: Qwen3-MoE's sparse-step layout with a shared expert and MTP layers under `mtp.` (resolves and explains; the runtime does not build it yet)."""

from __future__ import annotations

from families.base import BASE_KEYS, FamilySpec, keys, optional
from families.qwen3_moe.spec import SPARSE_STEP_KEYS, check_sparse_step, sparse_step

SPEC = FamilySpec(
    name="qwen3_next",
    runtime=False,
    architectures=("Qwen3NextForCausalLM",),
    keys=keys(BASE_KEYS, SPARSE_STEP_KEYS, {
        "mtp_num_hidden_layers": optional("count"),
        "shared_expert_intermediate_size": optional("dim"),
    }),
    moe_layers=sparse_step,
    experts_key="num_experts",
    intermediate_key="moe_intermediate_size",
    check=check_sparse_step,
    draft_experts_prefix="mtp.layers.{k}.mlp.experts",
    draft_count_key="mtp_num_hidden_layers",
)

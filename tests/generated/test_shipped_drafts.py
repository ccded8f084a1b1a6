"""The shipped draft scenarios have checked-in draft builds bound for the draft's own formats (RULES DR1, DR2): R1 NVFP4 with its BF16 MTP layer, GLM-5.2 with its NVFP4 MTP layer, the Qwen3.8-style NVFP4 target with an FP8-block MTP layer (qwen3_8_flash on its own family, qwen3_next, and a GLM-5.2 variant), kimi_k3's external drafter, qwen3_30b_a3b's Eagle3 head; each constructs on the meta device."""
from __future__ import annotations

import pytest
import torch

from tests.generated import builds

# (build, the draft's (layer, id) table, the id its target layers bind): the draft's format is its own.
CASES = {
    "deepseek_r1_nvfp4.deepseek_r1_nvfp4__sm_100__tp8": (((61, "torch.grouped_mm.grouped_gemm.bf16"),), "torch.eager.loop.nvfp4"),
    "glm_5_2.glm_5_2_nvfp4__sm_107__low_latency": (((92, "torch.eager.loop.nvfp4"),), "torch.eager.loop.nvfp4"),
    "glm_5_2.glm_5_2_nvfp4_fp8mtp__sm_107__low_latency": (
        ((92, "torch.grouped_mm.grouped_gemm.fp8_block_scales"),), "torch.eager.loop.nvfp4"),
    "kimi_k3.kimi_k3_mxfp4__sm_100__tp16_moetp4ep4": (
        ((1, "torch.grouped_mm.grouped_gemm.bf16"),), "torch.grouped_mm.grouped_gemm.w4a16_mxfp4"),
    "qwen3_8_flash.qwen3_8_flash_nvfp4__sm_100__tp1": (
        ((48, "torch.grouped_mm.grouped_gemm.fp8_block_scales"),), "torch.eager.loop.nvfp4"),
    "qwen3_30b_a3b.qwen3_30b_a3b_bf16__sm_100__tp1": ((), "torch.grouped_mm.grouped_gemm.bf16"),  # Eagle3: no MoE layer
}
INPUTS = {"mtp": "hidden", "draft_target": "tokens", "eagle3": "aux_hidden"}


@pytest.mark.parametrize("build", sorted(CASES))
def test_a_shipped_scenarios_draft_is_bound_for_its_own_format(build):
    draft_layers, target_impl = CASES[build]
    modeling, draft = builds.load(f"generated.{build}.modeling"), builds.load(f"generated.{build}.draft")
    assert draft.DRAFT_LAYERS == draft_layers
    assert {i for _, i in modeling.LAYERS if i} == {target_impl}   # LAYERS: runs (range, id)
    built = draft.DRAFT_CLASS(device="meta", dtype=torch.bfloat16)
    assert type(built).INPUT == INPUTS[draft.MODE]


def test_the_qwen3_8_flash_mtp_draft_binds_fp8_block_experts_beside_nvfp4_ones_and_explain_names_both_builds():
    """The mixed-precision scenario: the draft's MTP experts construct as the FP8-block class, the target's as the
    NVFP4 one, and `explain` names the target build load_model loads and its draft.py (RULES TG6)."""
    from runtime.experts.base import ExpertsBase

    build = "qwen3_8_flash.qwen3_8_flash_nvfp4__sm_100__tp1"
    modeling, draft = builds.load(f"generated.{build}.modeling"), builds.load(f"generated.{build}.draft")
    built = draft.DRAFT_CLASS(device="meta")
    experts = [m for m in built.modules() if isinstance(m, ExpertsBase)]
    assert [type(e) for e in experts] == [draft.IMPLEMENTATIONS["torch.grouped_mm.grouped_gemm.fp8_block_scales"][0]]
    assert modeling.IGNORED_TENSORS == ("mtp.*",) and draft.IGNORED_TENSORS == ("model.layers.*", "model.norm.*")
    text = builds.codegen_cli("explain", "--model", "qwen3_8_flash", "--sm", "100", "--spec-mode", "mtp")
    assert "  -> load_model loads qwen3_8_flash_nvfp4__sm_100__tp1\n" in text
    assert ("  draft build: generated/qwen3_8_flash/qwen3_8_flash_nvfp4__sm_100__tp1/draft.py (embedded_mtp qwen3_8_flash_mtp)\n"
            in text)

"""VANILLA experts against transformers' experts modules (bf16 weights) and, for every run format,
against the float64 reference of helpers_experts.

Tolerances, as relative errors (RMS: ||y - ref|| / ||ref||; max: max|y - ref| / max|ref|):
- fp32 hidden: 1e-5 both. VANILLA computes in fp32, so what is left is fp32 rounding; a missing
  activation quantization costs 4e-2 or more.
- bf16 hidden vs the float64 reference rounded to bf16: RMS 1e-3, max 2^-8 (one bf16 ulp at the
  top binade): outputs are rounded once, at the end, and a few round the other way.
- bf16 hidden vs transformers in bf16, which rounds every intermediate to bf16: RMS 1e-2, max 2e-2.
"""
import pytest
import torch
from transformers import GptOssConfig, MixtralConfig, NemotronHConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.vanilla import TorchEagerBf16Experts

from .helpers_experts import (assert_rel_close, make_expert_tensors, random_hidden, random_routing, reference_moe,
                              registry_classes)

BY_FORMAT = {cls.FORMAT: cls for cls in registry_classes("VANILLA")}


# --- against transformers ---------------------------------------------------------------------------

def _hf_module(kind, spec):
    common = dict(hidden_size=spec.hidden_size, num_experts_per_tok=spec.top_k)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(moe_intermediate_size=spec.intermediate_size, num_experts=spec.num_experts, **common)
        module = Qwen3MoeExperts(config)
    elif kind == "mixtral":
        config = MixtralConfig(intermediate_size=spec.intermediate_size, num_local_experts=spec.num_experts, **common)
        module = MixtralExperts(config)
    elif kind == "gpt_oss":
        config = GptOssConfig(intermediate_size=spec.intermediate_size, num_local_experts=spec.num_experts,
                              swiglu_limit=spec.swiglu_limit, **common)
        module = GptOssExperts(config)
    else:
        config = NemotronHConfig(moe_intermediate_size=spec.intermediate_size, n_routed_experts=spec.num_experts,
                                 mlp_hidden_act="relu2", **common)
        module = NemotronHExperts(config)
    config._experts_implementation = "eager"
    return module


def _copy_weights(kind, module, tensors, spec):
    w = lambda e, p: tensors[e, p, "weight"].float()   # noqa: E731
    with torch.no_grad():
        for e in range(spec.num_experts):
            if kind in ("qwen3_moe", "mixtral"):
                module.gate_up_proj[e] = torch.cat([w(e, "gate"), w(e, "up")])      # [gate; up] rows
                module.down_proj[e] = w(e, "down")
            elif kind == "gpt_oss":                                                # [in, out], interleaved
                module.gate_up_proj[e, :, 0::2] = w(e, "gate").T
                module.gate_up_proj[e, :, 1::2] = w(e, "up").T
                module.gate_up_proj_bias[e, 0::2] = tensors[e, "gate", "bias"].float()
                module.gate_up_proj_bias[e, 1::2] = tensors[e, "up", "bias"].float()
                module.down_proj[e] = w(e, "down").T
                module.down_proj_bias[e] = tensors[e, "down", "bias"].float()
            else:
                module.up_proj[e] = w(e, "up")
                module.down_proj[e] = w(e, "down")


HF_CASES = {
    "qwen3_moe": MoeShape(64, 48, 6, 2, "silu_glu"),
    "mixtral": MoeShape(40, 72, 4, 2, "silu_glu"),
    "gpt_oss": MoeShape(48, 32, 5, 3, "swiglu_oai", expert_bias=True),
    "nemotron_h": MoeShape(56, 40, 6, 3, "relu2"),
}


@pytest.mark.parametrize("kind", HF_CASES)
def test_vanilla_bf16_matches_transformers_experts(kind):
    spec = HF_CASES[kind]
    # gpt-oss weights large enough that its clamps (limit 7) are reached
    tensors = make_expert_tensors(spec, "bf16", seed=11, weight_std=4.0 if kind == "gpt_oss" else 1.0)
    hf = _hf_module(kind, spec)
    _copy_weights(kind, hf, tensors, spec)
    ours = TorchEagerBf16Experts.from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    ids, weights = random_routing(40, spec, seed=12)

    hidden = random_hidden(40, spec, seed=13, dtype=torch.float32)
    expected = hf.float()(hidden, ids, weights)
    assert_rel_close(ours(hidden, ids, weights), expected, 1e-5, 1e-5)

    hidden = hidden.bfloat16()
    out = ours(hidden, ids, weights)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, hf.bfloat16()(hidden, ids, weights.bfloat16()), 1e-2, 2e-2)


def test_gpt_oss_case_reaches_the_clamps():
    spec = HF_CASES["gpt_oss"]
    tensors = make_expert_tensors(spec, "bf16", seed=11, weight_std=4.0)
    hidden = random_hidden(40, spec, seed=13, dtype=torch.float32)
    gate = hidden @ tensors[0, "gate", "weight"].float().T
    up = hidden @ tensors[0, "up", "weight"].float().T
    assert (gate > spec.swiglu_limit).any() and (up.abs() > spec.swiglu_limit).any()


# --- every run format against the float64 reference -------------------------------------------------

SHAPES = {"bf16": (40, 24), "fp8_block_scales": (200, 136), "w4a16_mxfp4": (64, 96),
          "w4a8_mxfp4_fp8": (64, 96), "w4a8_mxfp4_mxfp8": (64, 96), "w4a16_nvfp4": (48, 80), "nvfp4": (48, 80)}
ACTS = {"silu_glu": dict(), "swiglu_oai": dict(expert_bias=True), "relu2": dict()}


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("fmt", BY_FORMAT)
def test_vanilla_matches_float64_reference(fmt, activation):
    h, i = SHAPES[fmt]
    spec = MoeShape(h, i, 5, 2, activation, **ACTS[activation])
    swiglu = activation == "swiglu_oai"
    tensors = make_expert_tensors(spec, fmt, seed=21, weight_std=3.0 if swiglu else 1.0,
                                  input_amax=(12.0, 12.0, 60.0) if swiglu else (4.5, 4.0, 3.0))
    module = BY_FORMAT[fmt].from_checkpoint(spec, ExpertParallel(), DictExpertSource(tensors))
    ids, weights = random_routing(24, spec, seed=22)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = random_hidden(24, spec, seed=23, dtype=dtype)
        out = module(hidden, ids, weights)
        assert out.dtype == dtype
        expected = reference_moe(hidden, ids, weights, tensors, spec, fmt)
        if dtype == torch.float32:
            assert_rel_close(out, expected, 1e-5, 1e-5)
        else:
            assert_rel_close(out, expected.bfloat16(), 1e-3, 2.0 ** -8)

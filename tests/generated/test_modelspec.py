"""The constants a generated build inlines mean what transformers makes of the same config keys, for every declaration of a runtime family (the checkpoint's meaning is transformers' config class, not our reading of it; codegen/modelspec.py).

Values are read from the generated generic build of each declared model (what the template inlined),
and compared with the transformers config class built from the declaration's keys, its rotary class
(inv_freq and attention scaling, the rotary oracle) and, for MLA, its attention's softmax scale.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from codegen.import_checkpoint import declaration_config
from codegen.modelspec import normalize
from families import RUNTIME_FAMILIES
from registry.normal_config import DEFAULTS
from runtime.ops import RotaryEmbedding
from tests.generated import builds

MODELS = sorted(m for m in builds.index()["models"] if builds.facts(m).FAMILY in RUNTIME_FAMILIES)


def _hf_module(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _hf_class(family: str, suffix: str):
    module = _hf_module(family)
    return next(getattr(module, n) for n in dir(module) if n.endswith(suffix) and not n.startswith("_"))


def _hf_windows(family: str, hc) -> tuple:
    if family == "gpt_oss":
        return tuple(hc.sliding_window if t == "sliding_attention" else None for t in hc.layer_types)
    if family in ("qwen3_moe", "mixtral"):  # Qwen3-MoE's config already drops the window without use_sliding_window
        return (hc.sliding_window,) * hc.num_hidden_layers
    return (None,) * hc.num_hidden_layers  # DeepSeek-V3, GLM-4 MoE and MiniMax-M2 have no sliding window


# Constants of the family templates and the transformers config attribute each inlines.
_CONSTANT_KEYS = {
    "VOCAB_SIZE": "vocab_size", "HIDDEN_SIZE": "hidden_size", "NUM_HEADS": "num_attention_heads",
    "NUM_KV_HEADS": "num_key_value_heads", "NORM_TOPK_PROB": "norm_topk_prob", "ATTENTION_BIAS": "attention_bias",
    "N_GROUP": "n_group", "TOPK_GROUP": "topk_group", "NUM_SHARED_EXPERTS": "n_shared_experts",
    "ROUTED_SCALING_FACTOR": "routed_scaling_factor", "RMS_NORM_EPS": "rms_norm_eps",
    "INTERMEDIATE_SIZE": "intermediate_size", "MOE_INTERMEDIATE_SIZE": "moe_intermediate_size",
    "MAMBA_NUM_HEADS": "mamba_num_heads", "MAMBA_HEAD_DIM": "mamba_head_dim", "SSM_STATE_SIZE": "ssm_state_size",
    "N_GROUPS": "n_groups", "CONV_KERNEL": "conv_kernel", "USE_CONV_BIAS": "use_conv_bias",
}


@pytest.mark.parametrize("model", MODELS)
def test_the_inlined_constants_mean_what_transformers_reads_from_the_same_keys(model):
    family = builds.facts(model).FAMILY
    ours = builds.load(f"generated.{model}.generic.modeling")
    hc = builds.hf_config(model)
    # (OLMoE's config class has no head_dim attribute at all: transformers falls back the same way.)
    head_dim = hc.qk_rope_head_dim if family == "deepseek_v3" else getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    if family == "nemotron_h":
        # No rotary in transformers' Nemotron-H (no rope key, no RotaryEmbedding): the build inlines none either.
        assert not hasattr(hc, "rope_parameters") and not hasattr(ours, "ROPE")
        assert ours.LAYER_NORM_EPS == hc.layer_norm_epsilon and ours.PATTERN == hc.hybrid_override_pattern
        assert ours.SHARED_INTERMEDIATE_SIZE == hc.moe_shared_expert_intermediate_size
    else:
        # Rotary: kind, base, rotated dims, and the tables themselves (YaRN's ramp and attention factor).
        rope = hc.rope_parameters
        assert (ours.ROPE["scaling"], ours.ROPE["base"]) == (rope["rope_type"], rope["rope_theta"])
        assert ours.ROPE["rotary_dim"] == int(head_dim * rope.get("partial_rotary_factor", 1.0))
        theirs = _hf_class(family, "RotaryEmbedding")(hc)
        mine = RotaryEmbedding(**ours.ROPE)
        torch.testing.assert_close(mine.inv_freq, theirs.inv_freq.float(), rtol=1e-6, atol=0)
        assert math.isclose(mine.attention_scaling, theirs.attention_scaling, rel_tol=1e-12)
        assert ours.RMS_NORM_EPS == hc.rms_norm_eps

    # Qwen3-Next's config class has no num_local_experts alias.
    assert (ours.NUM_EXPERTS, ours.TOP_K) == (getattr(hc, "num_local_experts", None) or hc.num_experts, hc.num_experts_per_tok)
    if family == "deepseek_v3":
        assert (ours.Q_LORA_RANK, ours.KV_LORA_RANK) == (hc.q_lora_rank, hc.kv_lora_rank)
        assert (ours.QK_NOPE_HEAD_DIM, ours.QK_ROPE_HEAD_DIM, ours.V_HEAD_DIM) == (hc.qk_nope_head_dim, hc.qk_rope_head_dim, hc.v_head_dim)
        assert (ours.ATTENTION_BIAS, ours.INTERLEAVED_ROPE) == (hc.attention_bias, hc.rope_interleave)
        with torch.device("meta"):
            attention = _hf_class(family, "Attention")(hc, 0)
        assert math.isclose(ours.SOFTMAX_SCALE, attention.scaling, rel_tol=1e-12)
    else:
        assert (ours.HEAD_DIM, ours.NUM_KV_HEADS) == (head_dim, hc.num_key_value_heads)
        # A template without the constant builds no window at all (GLM-4 MoE, MiniMax-M2).
        assert getattr(ours, "SLIDING_WINDOWS", (None,) * hc.num_hidden_layers) == _hf_windows(family, hc)
    if family in ("deepseek_v3", "glm4_moe"):
        assert (ours.N_GROUP, ours.TOPK_GROUP, ours.NUM_SHARED_EXPERTS) == (hc.n_group, hc.topk_group, hc.n_shared_experts)
        assert ours.ROUTED_SCALING_FACTOR == hc.routed_scaling_factor
    if family in ("deepseek_v3", "glm4_moe", "qwen3_moe"):
        assert ours.NORM_TOPK_PROB == hc.norm_topk_prob
    if family == "mixtral":
        assert ours.NORM_TOPK_PROB is True  # Mixtral always renormalizes (no config key; MiniMax-M2 likewise, inline)
    if family in ("glm4_moe", "qwen3_moe", "gpt_oss"):
        assert ours.ATTENTION_BIAS == hc.attention_bias
    if family == "glm4_moe":
        assert ours.QK_NORM == ("head" if hc.use_qk_norm else "none")
    if family == "gpt_oss":
        assert (ours.EXPERTS_SPEC.swiglu_alpha, ours.EXPERTS_SPEC.swiglu_limit) == (hc.swiglu_alpha, hc.swiglu_limit)
    if family == "qwen3_next":
        assert ours.FULL_ATTENTION_LAYERS == tuple(i for i, t in enumerate(hc.layer_types) if t == "full_attention")
        assert "linear_attention" in hc.layer_types
        linear = (ours.LINEAR_NUM_KEY_HEADS, ours.LINEAR_NUM_VALUE_HEADS, ours.LINEAR_KEY_HEAD_DIM, ours.LINEAR_VALUE_HEAD_DIM)
        assert linear == (hc.linear_num_key_heads, hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim)
        assert (ours.LINEAR_CONV_KERNEL, ours.SHARED_EXPERT_INTERMEDIATE_SIZE) == (hc.linear_conv_kernel_dim, hc.shared_expert_intermediate_size)
    # Any family (one added later included): a constant the build inlines equals the config attribute it comes from.
    for constant, key in _CONSTANT_KEYS.items():
        if hasattr(ours, constant) and hasattr(hc, key):
            assert getattr(ours, constant) == getattr(hc, key), (constant, key)


@pytest.mark.parametrize("family", sorted(builds.TINY))
def test_a_config_as_transformers_5_writes_it_normalizes_as_the_hub_spelling_does(family):
    # save_pretrained writes `rope_parameters` (not rope_theta/rope_scaling/partial_rotary_factor/rotary_dim)
    # and canonical names (`num_local_experts`); import-checkpoint turns that into a declaration.
    model = builds.TINY[family]
    declared = dict(builds.facts(model).CONFIG)
    written = declaration_config(builds.hf_config(model).to_dict(), family)
    hub, saved = normalize(family, declared), normalize(family, written)
    assert {k: saved.get(k) for k in hub if k != "architectures"} == {k: v for k, v in hub.items() if k != "architectures"}


@pytest.mark.parametrize("family", sorted(DEFAULTS))
def test_every_family_default_is_the_transformers_config_class_default(family):
    from transformers import AutoConfig

    hc = AutoConfig.for_model(family)
    for key, value in DEFAULTS[family].items():
        if key in ("rope_theta", "partial_rotary_factor"):
            theirs = hc.rope_parameters.get(key)
        elif key == "rope_scaling":
            theirs = {k: v for k, v in hc.rope_parameters.items() if k != "rope_theta"}
        elif key == "sliding_window" and family == "qwen3_moe":
            theirs = type(hc).__dataclass_fields__[key].default  # the instance drops it without use_sliding_window
        else:
            theirs = getattr(hc, key)
        assert value == theirs, (family, key)

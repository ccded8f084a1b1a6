"""Expert activations against transformers' own modules (GptOss `_apply_gate`, ACT2FN)."""
import pytest
import torch
from transformers import GptOssConfig
from transformers.activations import ACT2FN
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from runtime import activations


def _rand(shape, seed, scale=4.0, dtype=torch.float32):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_oai_matches_gpt_oss_apply_gate(dtype):
    config = GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=2, num_experts_per_tok=1,
                          swiglu_limit=7.0)
    experts = GptOssExperts(config)
    gate_up = _rand((16, 96), 1, scale=6.0, dtype=dtype)     # interleaved rows: gate 2j, up 2j+1
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert (gate > 7).any() and (up.abs() > 7).any()          # both clamps are exercised
    expected = experts._apply_gate(gate_up)
    ours = activations.swiglu_oai(gate, up, alpha=experts.alpha, limit=experts.limit)
    assert torch.equal(ours, expected)
    assert torch.equal(activations.apply("swiglu_oai", gate, up, alpha=1.702, limit=7.0), expected)


def test_swiglu_oai_limit_and_alpha_are_used():
    gate, up = _rand((64,), 2, 6.0), _rand((64,), 3, 6.0)
    base = activations.swiglu_oai(gate, up)
    assert not torch.equal(base, activations.swiglu_oai(gate, up, limit=3.0))
    assert not torch.equal(base, activations.swiglu_oai(gate, up, alpha=1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_glu_and_relu2_match_act2fn(dtype):
    gate, up = _rand((8, 40), 4, dtype=dtype), _rand((8, 40), 5, dtype=dtype)
    assert torch.equal(activations.silu_glu(gate, up), ACT2FN["silu"](gate) * up)
    assert torch.equal(activations.apply("silu_glu", gate, up), ACT2FN["silu"](gate) * up)
    assert torch.equal(activations.relu2(up), ACT2FN["relu2"](up))
    assert torch.equal(activations.apply("relu2", None, up), ACT2FN["relu2"](up))


def test_apply_rejects_unknown_kinds_and_gate_mismatch():
    x = _rand((4,), 6)
    with pytest.raises(ValueError) as err:
        activations.apply("gelu", x, x)
    assert str(err.value) == "unknown expert activation 'gelu'; known: silu_glu, swiglu_oai, relu2"
    with pytest.raises(ValueError) as err:
        activations.apply("relu2", x, x)
    assert str(err.value) == "activation relu2 takes no gate projection"
    with pytest.raises(ValueError) as err:
        activations.apply("silu_glu", None, x)
    assert str(err.value) == "activation silu_glu needs a gate projection"

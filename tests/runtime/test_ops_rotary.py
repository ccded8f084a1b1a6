"""Rotary embeddings against each family's transformers rotary module and `apply_rotary_pos_emb`.

Checked per family: the frequency table and attention factor (fp32, rtol 1e-6), and rotated q/k on
random positions up to 250 (fp32: atol 2e-5, the angle error of a 1-ulp frequency difference at that
position; bf16: 1 ulp of the value, the rotation runs in bf16 on both sides). DeepSeek's interleaved
rotation is compared after de-interleaving, since transformers writes its result in half-split order
(the order is irrelevant to q.k; both sides use the same one).
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops.rotary import RotaryEmbedding, apply_rotary, mla_softmax_scale


def _config(family, **kw):
    from transformers import AutoConfig

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoConfig.for_model(family, **{**base, **kw})


def _positions(seq=24, high=250, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (seq,), generator=g).sort().values


def _check(ours_rope, ref_rope, ref_apply, *, dtype, head_dim, interleaved=False, seed=0):
    positions = _positions(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(2, positions.numel(), 4, head_dim, generator=g).to(dtype)
    k = torch.randn(2, positions.numel(), 2, head_dim, generator=g).to(dtype)

    torch.testing.assert_close(ours_rope.inv_freq, ref_rope.inv_freq.float(), rtol=1e-6, atol=0)
    assert ours_rope.attention_scaling == pytest.approx(ref_rope.attention_scaling, rel=1e-12)

    cos, sin = ours_rope(positions)
    ref_cos, ref_sin = ref_rope(q, positions[None].expand(2, -1))
    ref_q, ref_k = ref_apply(q.transpose(1, 2), k.transpose(1, 2), ref_cos, ref_sin)
    ref_q, ref_k = ref_q.transpose(1, 2), ref_k.transpose(1, 2)
    our_q, our_k = apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
    if interleaved:
        rot = 2 * cos.shape[-1]

        def deinterleave(x):
            return torch.cat((x[..., 0:rot:2], x[..., 1:rot:2], x[..., rot:]), dim=-1)

        our_q, our_k = deinterleave(our_q), deinterleave(our_k)
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(our_q, ref_q, **tol)
    torch.testing.assert_close(our_k, ref_k, **tol)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_rotary_matches_qwen3_moe(dtype):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    config = _config("qwen3_moe", head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    ours = RotaryEmbedding(rotary_dim=16, base=1e6)
    _check(ours, m.Qwen3MoeRotaryEmbedding(config), m.apply_rotary_pos_emb, dtype=dtype, head_dim=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_partial_rotary_matches_glm4_moe(dtype):
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    config = _config("glm4_moe", head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e4))
    assert config.rope_parameters["partial_rotary_factor"] == 0.5  # GLM's default
    ours = RotaryEmbedding(rotary_dim=16, base=1e4)
    _check(ours, m.Glm4MoeRotaryEmbedding(config), m.apply_rotary_pos_emb, dtype=dtype, head_dim=32, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_dim_matches_minimax_m2(dtype):
    from transformers.models.minimax_m2 import modeling_minimax_m2 as m

    config = _config(
        # The checkpoints say `rotary_dim`; transformers < 5.2x ignores it, so the factor is stated as well.
        "minimax_m2", head_dim=32, rotary_dim=8,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25),
        bos_token_id=None, eos_token_id=None,
    )
    ours = RotaryEmbedding(rotary_dim=8, base=5e6)
    _check(ours, m.MiniMaxM2RotaryEmbedding(config), m.apply_rotary_pos_emb, dtype=dtype, head_dim=32, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_yarn_rotary_matches_gpt_oss(dtype):
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    # gpt-oss's real rope (head_dim 64, theta 150000, 32 x 4096) with the blend range left fractional.
    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, truncate=False)
    config = _config("gpt_oss", head_dim=64, max_position_embeddings=131072, rope_parameters=rope)
    kwargs = dict(rotary_dim=64, base=150000.0, scaling="yarn", factor=32.0, original_max_position_embeddings=4096)
    ours = RotaryEmbedding(truncate=False, **kwargs)
    assert ours.attention_scaling > 1.3  # 0.1 ln 32 + 1: gpt-oss scales cos/sin
    assert not torch.equal(ours.inv_freq, RotaryEmbedding(truncate=True, **kwargs).inv_freq)  # the flag matters here
    _check(ours, m.GptOssRotaryEmbedding(config), m.apply_rotary_pos_emb, dtype=dtype, head_dim=64, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mscale", [1.0, 0.707])
def test_interleaved_yarn_rotary_matches_deepseek_v3(dtype, mscale):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0, mscale=mscale, mscale_all_dim=1.0)
    config = _config("deepseek_v3", qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, rope_parameters=rope)
    ours = RotaryEmbedding(
        rotary_dim=16, base=10000.0, scaling="yarn", factor=40.0, original_max_position_embeddings=64,
        mscale=mscale, mscale_all_dim=1.0,
    )
    _check(
        ours, m.DeepseekV3RotaryEmbedding(config), m.apply_rotary_pos_emb_interleave, dtype=dtype, head_dim=16,
        interleaved=True, seed=4,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama3_rotary_matches_transformers(dtype):
    from transformers.models.llama import modeling_llama as m

    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    config = _config("llama", head_dim=64, rope_parameters=rope)
    ours = RotaryEmbedding(
        rotary_dim=64, base=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    _check(ours, m.LlamaRotaryEmbedding(config), m.apply_rotary_pos_emb, dtype=dtype, head_dim=64, seed=5)


@pytest.mark.parametrize("rope_type,factor", [("default", 1.0), ("yarn", 40.0), ("yarn", 4.0)])
def test_mla_softmax_scale_matches_deepseek_v3_attention(rope_type, factor):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope = dict(rope_type=rope_type, rope_theta=10000.0)
    if rope_type == "yarn":
        rope.update(factor=factor, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)
    config = _config("deepseek_v3", q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=24,
                     v_head_dim=16, rope_parameters=rope)
    expected = DeepseekV3Attention(config, 0).scaling
    assert mla_softmax_scale(32, rope_type, factor, 1.0 if rope_type == "yarn" else 0.0) == pytest.approx(expected)


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="dynamic"):
        RotaryEmbedding(rotary_dim=16, base=1e4, scaling="dynamic")

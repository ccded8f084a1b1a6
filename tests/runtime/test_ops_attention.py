"""GQA and MLA attention against the transformers attention module of each family, plus the static KV cache.

The reference gets transformers' own masks (`create_causal_mask` / `create_sliding_window_causal_mask`,
eager implementation) and its own rotary module; ours gets positions and `(cos, sin)` from our rotary.
Weights are random (norm weights around 1, biases and sinks non-zero) and copied by name, which also
checks that our submodule names are transformers'. Tolerances: fp32 atol 2e-5 on outputs of O(1);
bf16 4e-2 relative to the largest output (a few bf16 ulps: transformers rounds the scaled logits and,
for gpt-oss, the whole sink softmax to bf16, ours keeps them fp32). Cache: prefill then one-token decode
steps reproduce the uncached outputs of the same positions (fp32 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from tests.runtime.helpers_oracle import randomise_and_copy
from runtime.ops.gqa import GQAttention, kv_head_shard
from runtime.ops.mla import ABSORBED_MAX_TOKENS, MLAttention
from runtime.ops.rotary import RotaryEmbedding, mla_softmax_scale

B, S = 2, 10


def _config(family, **kw):
    from transformers import AutoConfig

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = AutoConfig.for_model(family, **{**base, **kw})
    config._attn_implementation = "eager"
    return config


def _mask(config, x, sliding):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    # The cache argument is positional: transformers renamed it (past_key_values -> cache) in 5.2x.
    return make(config, x, None, None, position_ids=torch.arange(x.shape[1])[None])


def _compare(ours, theirs, ref_rope, our_rope, config, dtype, seed, sliding=False):
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(B, S, config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    positions = torch.arange(S)
    with torch.no_grad():
        ref = theirs(x, ref_rope(x, positions[None].expand(B, -1)), _mask(config, x, sliding))[0]
        cos, sin = our_rope(positions)
        out = ours(x, positions, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    else:
        err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 4e-2, f"bf16 relative error {err:.3e}"
    return x, out


@torch.no_grad()
def _check_cache(ours, our_rope, x, full, prefill=S - 3, step=1):
    """Prefill `prefill` positions, then decode the rest `step` tokens at a time through a static cache."""
    cache = ours.new_cache(batch_size=B, max_seq_len=S + 6, dtype=x.dtype)
    positions = torch.arange(S)
    outs = [ours(x[:, :prefill], positions[:prefill], *our_rope(positions[:prefill]), cache)]
    for t in range(prefill, S, step):
        p = positions[t : t + step]
        outs.append(ours(x[:, t : t + step], p, *our_rope(p), cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_with_head_qk_norm_matches_qwen3_moe(dtype):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    config = _config("qwen3_moe", head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    theirs = m.Qwen3MoeAttention(config, 0)
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm="head", rms_norm_eps=1e-6)
    randomise_and_copy(theirs, ours, 0)
    x, out = _compare(ours, theirs, m.Qwen3MoeRotaryEmbedding(config), RotaryEmbedding(rotary_dim=16, base=1e6),
                      config, dtype, 1)
    if dtype == torch.float32:
        _check_cache(ours, RotaryEmbedding(rotary_dim=16, base=1e6), x, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_gqa_matches_mixtral(dtype):
    from transformers.models.mixtral import modeling_mixtral as m

    config = _config("mixtral", head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    theirs = m.MixtralAttention(config, 0)
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    randomise_and_copy(theirs, ours, 2)
    _compare(ours, theirs, m.MixtralRotaryEmbedding(config), RotaryEmbedding(rotary_dim=16, base=1e6), config, dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_qk_norm", [False, True])
def test_gqa_with_qkv_bias_and_partial_rotary_matches_glm4_moe(dtype, use_qk_norm):
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    config = _config("glm4_moe", head_dim=16, attention_bias=True, use_qk_norm=use_qk_norm,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))
    theirs = m.Glm4MoeAttention(config, 0)
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                       qk_norm="head" if use_qk_norm else "none", rms_norm_eps=config.rms_norm_eps)
    randomise_and_copy(theirs, ours, 4)
    rope = RotaryEmbedding(rotary_dim=8, base=1e4)
    x, out = _compare(ours, theirs, m.Glm4MoeRotaryEmbedding(config), rope, config, dtype, 5)
    if dtype == torch.float32:
        _check_cache(ours, rope, x, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_with_projection_qk_norm_matches_minimax_m2(dtype):
    from transformers.models.minimax_m2 import modeling_minimax_m2 as m

    config = _config("minimax_m2", head_dim=16, rotary_dim=8, bos_token_id=None, eos_token_id=None,
                     rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5))
    theirs = m.MiniMaxM2Attention(config, 0)
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm="projection",
                       rms_norm_eps=config.rms_norm_eps)
    randomise_and_copy(theirs, ours, 6)
    rope = RotaryEmbedding(rotary_dim=8, base=5e6)
    x, out = _compare(ours, theirs, m.MiniMaxM2RotaryEmbedding(config), rope, config, dtype, 7)
    if dtype == torch.float32:
        _check_cache(ours, rope, x, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", [0, 1])  # gpt-oss: even layers slide, odd layers see everything
def test_gqa_with_sinks_biases_and_window_matches_gpt_oss(dtype, layer):
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=8,
                beta_fast=32.0, beta_slow=1.0, truncate=False)
    config = _config("gpt_oss", head_dim=16, sliding_window=4, num_hidden_layers=2, rope_parameters=rope)
    theirs = m.GptOssAttention(config, layer)
    window = 4 if layer == 0 else None
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True,
                       sinks=True, sliding_window=window)
    randomise_and_copy(theirs, ours, 8)
    with torch.no_grad():
        theirs.sinks.mul_(10)  # sinks large enough to matter
        ours.sinks.copy_(theirs.sinks)
    our_rope = RotaryEmbedding(rotary_dim=16, base=150000.0, scaling="yarn", factor=32.0,
                               original_max_position_embeddings=8, truncate=False)
    x, out = _compare(ours, theirs, m.GptOssRotaryEmbedding(config), our_rope, config, dtype, 9, sliding=layer == 0)
    if dtype == torch.float32:
        _check_cache(ours, our_rope, x, out)


def _mla_config(q_lora_rank):
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    return _config("deepseek_v3", num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=24,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_parameters=rope, rope_interleave=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lora_rank", [None, 20])
def test_mla_matches_deepseek_v3(dtype, q_lora_rank):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    config = _mla_config(q_lora_rank)
    theirs = m.DeepseekV3Attention(config, 0)
    scale = mla_softmax_scale(24, "yarn", 4.0, 1.0)
    assert scale == pytest.approx(theirs.scaling) and scale != pytest.approx(24**-0.5)
    ours = MLAttention(hidden_size=64, num_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=12, softmax_scale=scale, rms_norm_eps=config.rms_norm_eps)
    randomise_and_copy(theirs, ours, 10)
    our_rope = RotaryEmbedding(rotary_dim=8, base=10000.0, scaling="yarn", factor=4.0,
                               original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)
    x, out = _compare(ours, theirs, m.DeepseekV3RotaryEmbedding(config), our_rope, config, dtype, 11)
    if dtype == torch.float32:
        _check_cache(ours, our_rope, x, out)
        # a prompt longer than ABSORBED_MAX_TOKENS is expanded into the cache (the default call's 7 are not)
        assert S - 1 > ABSORBED_MAX_TOKENS
        _check_cache(ours, our_rope, x, out, prefill=S - 1)
        # verify-sized blocks of 4 tokens attend in the absorbed form
        _check_cache(ours, our_rope, x, out, prefill=2, step=4)


def test_mla_cache_holds_only_the_latent_and_the_shared_rotated_key():
    ours = MLAttention(hidden_size=64, num_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=12, softmax_scale=0.2)
    cache = ours.new_cache(batch_size=3, max_seq_len=7, dtype=torch.bfloat16)
    assert cache.first.shape == (3, 1, 7, 24) and cache.second.shape == (3, 1, 7, 8)
    assert cache.first.untyped_storage().data_ptr() == cache.second.untyped_storage().data_ptr()


def test_kv_heads_split_or_replicate_over_tensor_parallel_ranks():
    assert [kv_head_shard(8, r, 4) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    # 2 kv heads on 8 ranks: ranks 0-3 hold head 0, ranks 4-7 head 1 (query heads 0-15 use head 0).
    assert [kv_head_shard(2, r, 8) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    with pytest.raises(ValueError):
        kv_head_shard(3, 0, 4)

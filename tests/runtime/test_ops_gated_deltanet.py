"""Qwen3-Next's token mixers against transformers' modules: the gated DeltaNet (its recurrent state cache
included) and the gated full attention (GQA with an output gate and zero-centred q/k norms).

Weights are random (norm weights around 1, A_log and dt_bias non-zero) and copied by name, which also
checks that our submodule names are transformers'. Tolerances, fp32: outputs of O(1) within atol 2e-5
(transformers' uncached path runs the chunked delta rule, ours the recurrent one: the same sums in
another order). Inputs longer than a chunk run our chunked form (transformers' too): the same atol. Cache: a
prefill then one-token steps equal the uncached outputs of the same positions (fp32 1e-5), and a second
prefill from position 0 starts from an empty state; a chunked forward continuing from a cached state
likewise.
"""
from __future__ import annotations

import pytest
import torch

from tests.runtime.helpers_oracle import randomise_and_copy
from runtime.ops import GatedDeltaNet, GQAttention, RotaryEmbedding
from runtime.ops import gated_deltanet

B, S = 2, 12
DIMS = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def _config():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_next", **DIMS)
    config._attn_implementation = "eager"
    return config


def _deltanet(seed=0):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    theirs = Qwen3NextGatedDeltaNet(_config(), 0).eval()
    ours = GatedDeltaNet(hidden_size=64, num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8, conv_kernel=4,
                         rms_norm_eps=1e-6, dtype=torch.float32)
    randomise_and_copy(theirs, ours, seed)
    return theirs, ours


@torch.no_grad()
def test_the_gated_deltanet_computes_transformers_outputs():
    theirs, ours = _deltanet()
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(1))
    expected = theirs(x)
    out = ours(x, torch.arange(S))
    assert expected.abs().max() > 0.05   # a mixer that output nothing would pass a loose atol
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


@torch.no_grad()
def test_the_gated_deltanet_decodes_through_its_state_to_its_full_outputs():
    _, ours = _deltanet(seed=2)
    gen = torch.Generator().manual_seed(3)
    x, other = torch.randn(B, S, 64, generator=gen), torch.randn(B, 5, 64, generator=gen)
    full = ours(x, torch.arange(S))
    cache = ours.new_cache(batch_size=B, max_seq_len=64, dtype=torch.float32)
    ours(other, torch.arange(5), cache=cache)        # a stale state that the next prefill must forget
    prefill = 7
    steps = [ours(x[:, :prefill], torch.arange(prefill), cache=cache)]
    steps += [ours(x[:, t:t + 1], torch.tensor([t]), cache=cache) for t in range(prefill, S)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.conv.shape == (B, ours.conv_dim, 3) and cache.memory.shape == (B, 4, 16, 8)


def _counting_chunked(monkeypatch):
    calls = []
    chunked = gated_deltanet.chunked_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return chunked(*args, **kwargs)
    monkeypatch.setattr(gated_deltanet, "chunked_gated_delta_rule", counted)
    return calls


@torch.no_grad()
def test_a_long_input_runs_chunked_to_transformers_outputs(monkeypatch):
    calls = _counting_chunked(monkeypatch)
    theirs, ours = _deltanet(seed=6)
    x = torch.randn(B, 150, 64, generator=torch.Generator().manual_seed(7))
    expected = theirs(x)
    out = ours(x, torch.arange(150))
    assert calls == [150]
    assert expected.abs().max() > 0.05
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


@torch.no_grad()
def test_chunked_forwards_continue_from_the_cached_state(monkeypatch):
    calls = _counting_chunked(monkeypatch)
    theirs, ours = _deltanet(seed=8)
    x = torch.randn(B, 215, 64, generator=torch.Generator().manual_seed(9))
    expected = theirs(x)
    cache = ours.new_cache(batch_size=B, max_seq_len=256, dtype=torch.float32)
    parts = [ours(x[:, :10], torch.arange(10), cache=cache),            # token by token
             ours(x[:, 10:150], torch.arange(10, 150), cache=cache),    # chunked, from the state after 10
             ours(x[:, 150:212], torch.arange(150, 212), cache=cache)]  # 62 <= a chunk: token by token
    parts += [ours(x[:, t:t + 1], torch.tensor([t]), cache=cache) for t in range(212, 215)]
    assert calls == [140]
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, atol=2e-5, rtol=0)


@torch.no_grad()
def test_the_gated_attention_computes_transformers_outputs():
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    config = _config()
    theirs = Qwen3NextAttention(config, 1).eval()
    ours = GQAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm="head", output_gate=True,
                       zero_centered_qk_norm=True, rms_norm_eps=1e-6, dtype=torch.float32)
    randomise_and_copy(theirs, ours, seed=4)
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(S)
    rope = config.rope_parameters
    rotary = RotaryEmbedding(scaling="default", base=rope["rope_theta"], rotary_dim=int(16 * rope["partial_rotary_factor"]))
    cos, sin = rotary(positions)
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=positions[None])
    expected, _ = theirs(x, Qwen3NextRotaryEmbedding(config)(x, positions[None]), mask)
    torch.testing.assert_close(ours(x, positions, cos, sin), expected, atol=2e-5, rtol=0)


def test_the_gated_deltanet_refuses_a_tensor_parallel_split_of_its_key_heads_that_is_not_exact():
    with pytest.raises(ValueError) as err:
        GatedDeltaNet(hidden_size=64, num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8, conv_kernel=4,
                      rms_norm_eps=1e-6, tp_rank=0, tp_size=4, dtype=torch.float32)
    assert str(err.value) == ("the gated DeltaNet's linear_num_key_heads 2 do not split over 4 tensor-parallel ranks; "
                              "choose a tp that divides them")

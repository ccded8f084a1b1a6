"""runtime.ops.mamba.Mamba2Mixer against transformers' NemotronHMamba2Mixer (transformers 5.24, its torch path), same weights, fp32.

Tolerance: max abs difference <= 1e-5 relative to the output's largest magnitude (transformers' chunked
scan and this sequential one sum the same terms in another order; observed ~1e-7). Decoding through a
`MambaState` (a prefill, then one-token steps) gives the full forward's outputs to the same tolerance. Inputs
longer than our chunk (128) run our chunked scan: transformers' output to the same tolerance, also when the
chunked forward continues from a cached state.
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops import mamba
from runtime.ops.mamba import Mamba2Mixer

nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
from transformers import NemotronHConfig  # noqa: E402

# Two groups of four heads, chunk_size 8 < the sequence length, so transformers' scan crosses chunks.
CONFIG = dict(hidden_size=48, mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=12, n_groups=2, conv_kernel=4,
              chunk_size=8, layer_norm_epsilon=1e-5, time_step_min=0.001, hybrid_override_pattern="M",
              num_hidden_layers=1, vocab_size=32)


def _pair(seed=0):
    torch.manual_seed(seed)
    config = NemotronHConfig(**CONFIG)
    theirs = nemotron_h.NemotronHMamba2Mixer(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.rand(8).log())     # decays in (0, 1) per step, some fast, some slow
        theirs.dt_bias.copy_(torch.randn(8))
    ours = Mamba2Mixer(hidden_size=48, num_heads=8, head_dim=6, state_size=12, n_groups=2, conv_kernel=4,
                       time_step_min=0.001, norm_eps=1e-5, dtype=torch.float32)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, theirs


def _close(a, b, tol=1e-5):
    return ((a - b).abs().max() / b.abs().max()).item() <= tol


def test_the_mixer_computes_transformers_output():
    ours, theirs = _pair()
    x = torch.randn(2, 21, 48)
    with torch.no_grad():
        expected = theirs(x)
        out = ours(x, torch.arange(21))
    assert _close(out, expected), (out - expected).abs().max()


def test_decoding_through_the_state_equals_the_full_forward():
    ours, _ = _pair(1)
    x = torch.randn(2, 12, 48)
    state = ours.new_cache(batch_size=2, max_seq_len=16, dtype=torch.float32)
    with torch.no_grad():
        full = ours(x, torch.arange(12))
        # A stale state from an earlier request: position 0 must start from zeros anyway.
        state.ssm.normal_()
        state.conv.normal_()
        steps = [ours(x[:, :7], torch.arange(7), state)]
        steps += [ours(x[:, t:t + 1], torch.tensor([t]), state) for t in range(7, 12)]
    assert _close(torch.cat(steps, dim=1), full)


def _counting_chunked(monkeypatch):
    calls = []
    chunked = mamba.chunked_scan

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return chunked(*args, **kwargs)
    monkeypatch.setattr(mamba, "chunked_scan", counted)
    return calls


def test_a_long_input_runs_chunked_to_transformers_output(monkeypatch):
    calls = _counting_chunked(monkeypatch)
    ours, theirs = _pair(2)
    x = torch.randn(2, 301, 48)
    with torch.no_grad():
        expected = theirs(x)
        out = ours(x, torch.arange(301))
    assert calls == [301]
    assert _close(out, expected), (out - expected).abs().max()


def test_a_chunked_forward_continues_from_the_cached_state(monkeypatch):
    calls = _counting_chunked(monkeypatch)
    ours, theirs = _pair(3)
    x = torch.randn(2, 250, 48)
    state = ours.new_cache(batch_size=2, max_seq_len=256, dtype=torch.float32)
    with torch.no_grad():
        expected = theirs(x)
        parts = [ours(x[:, :9], torch.arange(9), state), ours(x[:, 9:248], torch.arange(9, 248), state)]
        parts += [ours(x[:, t:t + 1], torch.tensor([t]), state) for t in range(248, 250)]
    assert calls == [239]
    assert _close(torch.cat(parts, dim=1), expected)


def test_the_mixer_refuses_a_tensor_parallel_split_of_its_groups_that_is_not_exact():
    with pytest.raises(ValueError) as err:
        Mamba2Mixer(hidden_size=48, num_heads=8, head_dim=6, state_size=12, n_groups=2, conv_kernel=4,
                    time_step_min=0.001, norm_eps=1e-5, tp_size=4)
    assert str(err.value) == ("the Mamba-2 mixer's n_groups 2 do not split over 4 tensor-parallel ranks; "
                              "choose a tp that divides them")

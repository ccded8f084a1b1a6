"""runtime.ops.mamba.Mamba2Mixer against a float64 token-by-token reference and transformers' NemotronHMamba2Mixer (torch path), same weights, fp32.

Both comparisons hold the max abs difference to 1e-5 of the output's largest magnitude. Measured on these
tests' inputs (CPU, torch 2.13; 21 tokens token by token, then 301 and 250 tokens chunked): ours against
float64 4.0e-7, 1.3e-6, 2.3e-6; transformers 5.25 (chunk_size 8) against float64 5.0e-7, 7.6e-7, 2.3e-6;
ours against transformers 1.0e-7, 1.1e-6, 2.2e-6. Decoding through a `MambaState` (a prefill, then
one-token steps) gives the full forward's outputs to the same tolerance, and so does a chunked forward
continuing from a cached state.

The step size has no floor. Two heads here have a `dt_bias` low enough that most of their steps fall below
`time_step_min` (where the checkpoint's `dt_bias` initialisation starts, not a bound), and clamping them to
it moves the float64 output by 2.5e-3, 8.6e-2, 4.5e-3: transformers <= 5.24 did so in its chunked prefill
(never in its decode step); 5.25 clamps to `time_step_limit`, `(0, inf)` by default, as Mamba-2 does.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
        theirs.dt_bias[:2] -= 8                     # most of these heads' steps below time_step_min
    ours = Mamba2Mixer(hidden_size=48, num_heads=8, head_dim=6, state_size=12, n_groups=2, conv_kernel=4,
                       norm_eps=1e-5, dtype=torch.float32)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, theirs


def _reference(mixer, hidden, floor=0.0):
    """The mixer's output from its weights in float64, the SSM one token at a time (`floor`: a least step size)."""
    w = {k: v.double() for k, v in mixer.state_dict().items()}
    heads, dim, n, groups = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.n_groups
    z, xbc, dt = F.linear(hidden.double(), w["in_proj.weight"]).split((heads * dim, mixer.conv_dim, heads), dim=-1)
    window = F.pad(xbc.transpose(1, 2), (mixer.conv_kernel - 1, 0))
    xbc = F.silu(F.conv1d(window, w["conv1d.weight"], w["conv1d.bias"], groups=mixer.conv_dim)).transpose(1, 2)
    x, b, c = xbc.split((heads * dim, groups * n, groups * n), dim=-1)
    x = x.unflatten(-1, (heads, dim))
    b, c = (t.unflatten(-1, (groups, n)).repeat_interleave(heads // groups, dim=-2) for t in (b, c))
    dt = F.softplus(dt + w["dt_bias"]).clamp(min=floor)
    decay = torch.exp(-w["A_log"].exp() * dt)                                   # [B, S, heads]
    h = torch.zeros(hidden.shape[0], heads, dim, n, dtype=torch.float64)
    ys = []
    for t in range(hidden.shape[1]):
        h = decay[:, t, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append((h @ c[:, t, :, :, None]).squeeze(-1) + w["D"][:, None] * x[:, t])
    gated = (torch.stack(ys, dim=1).flatten(2) * F.silu(z)).unflatten(-1, (groups, -1))
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)
    return F.linear(normed.flatten(-2) * w["norm.weight"], w["out_proj.weight"])


def _close(a, b, tol=1e-5):
    return ((a - b).abs().max() / b.abs().max()).item() <= tol


def test_the_mixer_computes_transformers_output():
    ours, theirs = _pair()
    x = torch.randn(2, 21, 48)
    with torch.no_grad():
        expected = theirs(x)
        out = ours(x, torch.arange(21))
    reference = _reference(ours, x)
    assert _close(out, reference), (out - reference).abs().max()
    assert _close(out, expected), (out - expected).abs().max()
    # The inputs take steps below time_step_min: a floor there would move the output past the tolerance.
    assert not _close(out, _reference(ours, x, floor=CONFIG["time_step_min"]))


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
    reference = _reference(ours, x)
    assert _close(out, reference), (out - reference).abs().max()
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
    out, reference = torch.cat(parts, dim=1), _reference(ours, x)
    assert _close(out, reference), (out - reference).abs().max()
    assert _close(out, expected), (out - expected).abs().max()


def test_the_mixer_refuses_a_tensor_parallel_split_of_its_groups_that_is_not_exact():
    with pytest.raises(ValueError) as err:
        Mamba2Mixer(hidden_size=48, num_heads=8, head_dim=6, state_size=12, n_groups=2, conv_kernel=4,
                    norm_eps=1e-5, tp_size=4)
    assert str(err.value) == ("the Mamba-2 mixer's n_groups 2 do not split over 4 tensor-parallel ranks; "
                              "choose a tp that divides them")

"""The chunked prefill scans (runtime/ops/gated_deltanet.py `chunked_gated_delta_rule`, runtime/ops/mamba.py
`chunked_scan`) against the token-by-token recurrences and a float64 reference written here from the recurrence
formulas, on fresh random inputs: odd lengths, lengths not a multiple of the chunk, one chunk or less, a non-zero
initial state.

Tolerances (fp32 against float64): outputs and final states within 2e-5 of the reference's largest magnitude
(observed ~1e-7 to 1e-6: the forms sum the same terms in another order).
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops.gated_deltanet import chunked_gated_delta_rule, gated_delta_rule
from runtime.ops.mamba import chunked_scan, scan

LENGTHS = [(1, 8), (7, 8), (8, 8), (9, 8), (45, 8), (131, 64), (200, 64)]


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    scale = ref.abs().max()
    assert scale > 0.05   # fresh inputs: a reference of zeros would let anything pass
    err = ((ours.double() - ref).abs().max() / scale).item()
    assert err <= tol, err


def _delta_rule_f64(q, k, v, g, beta, memory):
    """The gated delta rule in float64: l2-normalized q (scaled by Dk^-1/2) and k; per token decay, then the
    delta-rule write `M += k beta (v - M^T k)^T`; the output reads `M^T q`."""
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / q.shape[-1] ** 0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    out = torch.empty(*v.shape, dtype=torch.float64)
    for t in range(q.shape[1]):
        memory = memory * g[:, t, :, None, None].exp()
        error = v[:, t] - (memory * k[:, t, :, :, None]).sum(-2)
        memory = memory + k[:, t, :, :, None] * (beta[:, t, :, None] * error)[:, :, None, :]
        out[:, t] = (memory * q[:, t, :, :, None]).sum(-2)
    return out, memory


def _delta_inputs(seq, seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 5
    q, k = torch.randn(b, seq, h, dk, generator=gen), torch.randn(b, seq, h, dk, generator=gen)
    v = torch.randn(b, seq, h, dv, generator=gen)
    g = -torch.rand(b, seq, h, generator=gen) * 0.6          # decays exp(g) in (0.55, 1]
    beta = torch.rand(b, seq, h, generator=gen)
    memory = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, memory


@pytest.mark.parametrize("seq, chunk", LENGTHS)
def test_the_chunked_delta_rule_is_the_recurrence(seq, chunk):
    inputs = _delta_inputs(seq, seed=seq)
    ref_out, ref_memory = _delta_rule_f64(*(t.double() for t in inputs))
    out, memory = chunked_gated_delta_rule(*inputs, chunk=chunk)
    step_out, step_memory, _ = gated_delta_rule(*inputs)
    for ours, ref in ((out, ref_out), (memory, ref_memory), (step_out, ref_out), (step_memory, ref_memory)):
        _close(ours, ref)
    assert out.shape == step_out.shape == (2, seq, 3, 5) and out.dtype == torch.float32


def test_the_delta_rule_keeps_the_memory_after_each_token():
    inputs = _delta_inputs(5, seed=11)
    _, last, states = gated_delta_rule(*inputs, keep_states=True)
    assert states.shape == (5, 2, 3, 8, 5) and torch.equal(states[-1], last)
    for t in range(5):
        _, ref = _delta_rule_f64(*(x[:, :t + 1].double() for x in inputs[:5]), inputs[5].double())
        _close(states[t], ref)


def _scan_f64(x, dt, a, b, c, h):
    """The selective scan in float64: per head `h <- exp(dt a) h + dt x b^T`, `y = h c`; group g of b/c serves
    heads g * H/G .. (g + 1) * H/G - 1."""
    per = x.shape[2] // b.shape[2]
    y = torch.empty(*x.shape, dtype=torch.float64)
    for t in range(x.shape[1]):
        for head in range(x.shape[2]):
            grp = head // per
            h[:, head] = (h[:, head] * (dt[:, t, head] * a[head]).exp()[:, None, None]
                          + (dt[:, t, head, None] * x[:, t, head])[:, :, None] * b[:, t, grp, None, :])
            y[:, t, head] = (h[:, head] * c[:, t, grp, None, :]).sum(-1)
    return y, h


def _scan_inputs(seq, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, p, groups, n = 2, 4, 3, 2, 5
    x = torch.randn(batch, seq, heads, p, generator=gen)
    dt = torch.rand(batch, seq, heads, generator=gen) * 0.5 + 0.01
    a = -torch.rand(heads, generator=gen) * 2
    b, c = torch.randn(batch, seq, groups, n, generator=gen), torch.randn(batch, seq, groups, n, generator=gen)
    h = torch.randn(batch, heads, p, n, generator=gen)
    return x, dt, a, b, c, h


@pytest.mark.parametrize("seq, chunk", LENGTHS)
def test_the_chunked_ssd_scan_is_the_recurrence(seq, chunk):
    inputs = _scan_inputs(seq, seed=100 + seq)
    ref_y, ref_h = _scan_f64(*(t.double() for t in inputs))
    y, h = chunked_scan(*inputs, chunk=chunk)
    step_y, step_h, _ = scan(*inputs)
    for ours, ref in ((y, ref_y), (h, ref_h), (step_y, ref_y), (step_h, ref_h)):
        _close(ours, ref)
    assert y.shape == step_y.shape == (2, seq, 4, 3)


def test_the_scan_keeps_the_state_after_each_token():
    inputs = _scan_inputs(4, seed=12)
    _, last, states = scan(*inputs, keep_states=True)
    assert states.shape == (4, 2, 4, 3, 5) and torch.equal(states[-1], last)
    for t in range(4):
        x, dt, a, b, c, h = (v.double() for v in inputs)
        _, ref = _scan_f64(x[:, :t + 1], dt[:, :t + 1], a, b[:, :t + 1], c[:, :t + 1], h)
        _close(states[t], ref)

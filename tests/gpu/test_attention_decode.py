"""The split-K decode attention kernel (runtime/kernels/attention_decode.py, the one-token cached step of
`attention_fused.attention`) computes the eager reference's function: GQA over a heads-major static cache,
sliding windows, gpt-oss sinks, slots after the query position holding stale values (issue 12).

Oracle: `eager_attention` on the same inputs in float64; bf16 inputs land within 1e-2 relative. Fresh random
inputs every case; a graph replay equals the eager call.
"""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import attention_decode
from runtime.ops import attention_fused
from runtime.ops.attention_core import eager_attention

pytestmark = pytest.mark.gpu

# name: (B, Hq, Hkv, D, L, query position, window, sinks)
CASES = {
    "qwen3_b1": (1, 32, 4, 128, 1088, 1024, None, False),
    "qwen3_b8": (8, 32, 4, 128, 1088, 1024, None, False),
    "gpt_oss_sliding_sinks": (2, 64, 8, 64, 1088, 1000, 128, True),
    "gpt_oss_full_sinks": (3, 64, 8, 64, 700, 333, None, True),
    "mha_ragged_length": (2, 4, 4, 64, 77, 76, None, False),
    "one_kv_head_early": (2, 16, 1, 256, 300, 3, None, False),
}


def _inputs(case):
    batch, hq, hkv, d, length, position, window, sinks = CASES[case]
    gen = torch.Generator(device="cuda")
    gen.seed()

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q = rand(batch, 1, hq, d)
    k = rand(batch, hkv, length, d, scale=2.0)
    v = rand(batch, hkv, length, d)
    sink = rand(hq, scale=1.5) if sinks else None
    return q, k, v, torch.tensor([position], device="cuda"), torch.arange(length, device="cuda"), window, sink


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_kernel_matches_the_eager_reference(case):
    q, k, v, qp, kp, window, sinks = _inputs(case)
    scale = q.shape[-1] ** -0.5
    assert attention_decode.applies(q, k, v, qp, kp)
    out = attention_fused.attention(q, k, v, qp, kp, scale, window, sinks)
    ref = eager_attention(q.double(), k.double(), v.double(), qp, kp, scale, window,
                          None if sinks is None else sinks.double())
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.2e}"
    # Stale slots after the position must not count: change them and the output stays.
    k[:, :, qp.item() + 1 :] = 7.0
    assert torch.equal(attention_fused.attention(q, k, v, qp, kp, scale, window, sinks), out)


def test_decode_kernel_replays_in_a_cuda_graph():
    q, k, v, qp, kp, window, sinks = _inputs("gpt_oss_sliding_sinks")
    scale = q.shape[-1] ** -0.5
    attention_fused.attention(q, k, v, qp, kp, scale, window, sinks)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_fused.attention(q, k, v, qp, kp, scale, window, sinks)
    qp.fill_(1040)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert torch.equal(out, attention_fused.attention(q, k, v, qp, kp, scale, window, sinks))

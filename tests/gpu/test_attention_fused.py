"""The fused CUDA attention (runtime/ops/attention_fused.py) computes the eager reference's function: GQA
prefill through the causal flash path, sliding windows, gpt-oss sinks (log-sum-exp rescaling), cached
steps over a static heads-major buffer, MLA head dims (issue 12).

Oracle: `eager_attention` on the same inputs upcast to float64 (on the GPU). bf16 inputs: the fused output
must land within 1e-2 relative (bf16 operands with fp32 accumulation sit between 1e-3 and 1e-2); fresh
random inputs every case, keys and values scaled so the softmax is neither flat nor one-hot.
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops import attention_fused
from runtime.ops.attention_core import eager_attention

pytestmark = pytest.mark.gpu

# name: (Hq, Hkv, D, Dv, S, L, window, sinks, self_keys)
CASES = {
    "gqa_prefill_causal": (8, 2, 64, 64, 300, 300, None, False, True),
    "mha_prefill_causal": (4, 4, 128, 128, 129, 129, None, False, True),
    "gqa_prefill_window": (8, 2, 64, 64, 200, 200, 48, False, True),
    "gqa_prefill_sinks": (8, 2, 64, 64, 150, 150, None, True, True),
    "gqa_prefill_window_sinks": (8, 2, 64, 64, 150, 150, 32, True, True),
    "gqa_decode_cached": (32, 4, 128, 128, 1, 1100, None, False, False),
    "gqa_decode_cached_window_sinks": (64, 8, 64, 64, 1, 700, 128, True, False),
    "gqa_chunk_cached": (8, 2, 64, 64, 5, 90, None, False, False),
    "mla_prefill_head_dims": (16, 16, 192, 128, 77, 77, None, False, True),
    "mla_absorbed_decode": (16, 1, 576, 512, 1, 300, None, False, False),
}


def _inputs(case, batch=3, seed=None):
    hq, hkv, d, dv, s, length, window, sinks, self_keys = CASES[case]
    gen = torch.Generator(device="cuda")
    gen.seed() if seed is None else gen.manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q = rand(batch, s, hq, d)
    k = rand(batch, hkv, length, d, scale=2.0)
    v = rand(batch, hkv, length, dv)
    if self_keys:
        q_pos = torch.arange(s, device="cuda")
        k_pos = q_pos
    else:
        # A cached step: queries at the last filled positions; slots after them hold stale values.
        start = length - s - 7
        q_pos = torch.arange(start, start + s, device="cuda")
        k_pos = torch.arange(length, device="cuda")
    sink = rand(hq, scale=1.5) if sinks else None
    return q, k, v, q_pos, k_pos, window, sink, self_keys


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_attention_matches_the_eager_reference(case):
    q, k, v, q_pos, k_pos, window, sinks, self_keys = _inputs(case)
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        out = attention_fused.attention(q, k, v, q_pos, k_pos, scale, window, sinks, self_keys)
        ref = eager_attention(q.double(), k.double(), v.double(), q_pos, k_pos, scale, window,
                              None if sinks is None else sinks.double())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"{case}: relative error {err:.2e}"


def test_sinks_change_the_output():
    # The rescaling is not a no-op: without the sinks the same inputs give a clearly different output.
    q, k, v, q_pos, k_pos, window, sinks, self_keys = _inputs("gqa_prefill_sinks", seed=4)
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        with_sinks = attention_fused.attention(q, k, v, q_pos, k_pos, scale, window, sinks, self_keys)
        without = attention_fused.attention(q, k, v, q_pos, k_pos, scale, window, None, self_keys)
    assert float((with_sinks.float() - without.float()).norm() / without.float().norm()) > 0.05


def test_a_cached_step_reads_the_bf16_cache_in_place():
    # No copy or upcast of the cache: peak memory of a decode step over a 64 MiB cache stays far below it.
    q, k, v, q_pos, k_pos, window, sinks, _ = _inputs("gqa_decode_cached", batch=32, seed=5)
    cache_bytes = k.nbytes + v.nbytes
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        attention_fused.attention(q, k, v, q_pos, k_pos, scale)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention_fused.attention(q, k, v, q_pos, k_pos, scale)
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < cache_bytes / 16

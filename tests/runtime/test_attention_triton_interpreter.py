"""The Triton attention kernels (runtime/kernels/attention_prefill.py, and attention_decode.py sharing its mask
helper) in Triton's CPU interpreter against the float64 oracle: `eager_attention` on the same bf16 values upcast.

Runs only with Triton installed and `TRITON_INTERPRET=1` (e.g. `PYTHONPATH=/path/to/triton TRITON_INTERPRET=1
python -m pytest tests/runtime/test_attention_triton_interpreter.py`); the GPU tests are
tests/gpu/test_attention_prefill.py and tests/gpu/test_attention_decode.py. Fresh random inputs (keys scaled so
the softmax is neither flat nor one-hot, sinks of the logits' size), batch 2, positions offset from 0: a prompt
(keys = the queries' tokens), the prompt's gapped but increasing positions, and a prompt block over a static
cache whose later slots hold stale values. bf16 operands with fp32 accumulation: within 1e-2 relative (measured
about 4e-3 here, where the interpreter's casts to bf16 truncate instead of rounding).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs with TRITON_INTERPRET=1", allow_module_level=True)

from runtime.kernels import attention_decode, attention_prefill  # noqa: E402
from runtime.ops.attention_core import eager_attention  # noqa: E402
from tests.runtime.helpers_triton import bf16_dot  # noqa: E402,F401  (autouse fixture)

TOLERANCE = 1e-2


def _inputs(seq, q_heads, kv_heads, dim, mode, seed, batch=2, offset=5, sinks_dtype=torch.float32,
            dtype=torch.bfloat16):
    """`mode`: "prompt" (positions offset .. offset+S-1, keys the queries' own), "gapped" (increasing with
    gaps), "cached" (queries at offset .. offset+S-1 over a cache of offset+S+70 slots, `k_positions = arange`)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    length = offset + seq + 70 if mode == "cached" else seq
    q = rand(batch, seq, q_heads, dim)
    k = rand(batch, kv_heads, length, dim, scale=2.0)
    v = rand(batch, kv_heads, length, dim)
    if mode == "gapped":
        q_pos = torch.randperm(3 * seq + 4, generator=gen)[:seq].sort().values + offset
    else:
        q_pos = torch.arange(offset, offset + seq)
    k_pos = torch.arange(length) if mode == "cached" else q_pos
    sinks = (torch.randn(q_heads, generator=gen) * 1.5).to(sinks_dtype)
    return q, k, v, q_pos, k_pos, sinks


def _oracle(q, k, v, q_pos, k_pos, window, sinks):
    return eager_attention(q.double(), k.double(), v.double(), q_pos, k_pos, q.shape[-1] ** -0.5, window,
                           None if sinks is None else sinks.double())


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _check(seq, q_heads, kv_heads, dim, window, with_sinks, mode, seed, **kw):
    q, k, v, q_pos, k_pos, sinks = _inputs(seq, q_heads, kv_heads, dim, mode, seed, **kw)
    sinks = sinks if with_sinks else None
    out = attention_prefill.attention(q, k, v, q_pos, k_pos, dim ** -0.5, window, sinks)
    ref = _oracle(q, k, v, q_pos, k_pos, window, sinks)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < TOLERANCE, f"relative error {err:.2e}"
    return q, k, v, q_pos, k_pos, sinks, out


# gpt-oss's head grouping (8 query heads per key/value head, dim 64), every length, window and sink setting.
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [None, 4, 128], ids=["full", "w4", "w128"])
@pytest.mark.parametrize("seq", [1, 17, 130, 300])
def test_gqa_prompt_matches_the_float64_oracle(seq, window, with_sinks):
    _check(seq, 16, 2, 64, window, with_sinks, "prompt", seed=seq * 10 + (window or 0) + with_sinks)


# Groups 1 and 8, head dims 16 (the tiny gpt-oss build) to 128, each kind of positions.
# Offset 49 puts the last query of the cached block's first row tile (16 queries) on the first slot of a key
# tile; offset 57 its first query 7 keys before a key tile's end (the last tile every row of it sees whole).
@pytest.mark.parametrize("q_heads,kv_heads,dim,seq,window,with_sinks,mode,offset", [
    (2, 2, 64, 300, 128, True, "prompt", 5),
    (2, 2, 128, 130, 4, True, "prompt", 5),
    (16, 2, 128, 130, None, True, "prompt", 5),
    (16, 2, 128, 17, 128, False, "prompt", 5),
    (8, 2, 64, 130, 128, True, "prompt", 1),
    (4, 4, 128, 300, None, False, "gapped", 5),
    (16, 2, 64, 130, 4, True, "gapped", 5),
    (16, 2, 64, 130, 128, True, "cached", 5),
    (16, 2, 64, 17, None, True, "cached", 49),
    (16, 2, 64, 130, None, False, "cached", 57),
    (16, 2, 64, 130, 100, True, "cached", 57),
    (2, 2, 128, 1, 4, False, "cached", 5),
    (4, 2, 16, 40, 8, True, "prompt", 5),
    (8, 1, 32, 77, None, True, "cached", 5),
], ids=str)
def test_groups_head_dims_and_positions_match_the_float64_oracle(q_heads, kv_heads, dim, seq, window, with_sinks,
                                                                 mode, offset):
    _check(seq, q_heads, kv_heads, dim, window, with_sinks, mode, seed=seq + dim + q_heads, offset=offset)


def test_bf16_sinks_are_read_as_they_are():
    _check(130, 16, 2, 64, 128, True, "prompt", seed=3, sinks_dtype=torch.bfloat16)


def test_fp16_inputs_give_fp16_outputs():
    _check(130, 16, 2, 64, 4, True, "cached", seed=4, dtype=torch.float16)


def test_sinks_and_the_window_change_the_output():
    """The oracle's tolerance is far below what dropping the sink or the window does."""
    q, k, v, q_pos, k_pos, sinks, out = _check(130, 16, 2, 64, 4, True, "prompt", seed=8)
    assert _rel(out, _oracle(q, k, v, q_pos, k_pos, 4, None)) > 10 * TOLERANCE
    assert _rel(out, _oracle(q, k, v, q_pos, k_pos, None, sinks)) > 10 * TOLERANCE


def test_key_tiles_outside_every_window_are_never_read():
    """A 30-token block at positions 400..429 over a 600-slot cache with a 4-token window: the rows' band is
    keys 397..429, so only the key tiles holding it are visited. NaN in the values of every other tile (a
    visited tile would spread it: its masked keys weigh 0, and 0 * NaN is NaN) leaves the output the oracle's."""
    q, k, v, q_pos, k_pos, sinks = _inputs(30, 16, 2, 64, "cached", seed=9, offset=400)
    ref = _oracle(q, k, v, q_pos, k_pos, 4, sinks)
    block = attention_prefill.BLOCK_N
    first, last = 397 // block * block, (429 // block + 1) * block
    v[:, :, :first] = float("nan")
    v[:, :, last:] = float("nan")
    out = attention_prefill.attention(q, k, v, q_pos, k_pos, 64 ** -0.5, 4, sinks)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOLERANCE


def test_stale_cache_slots_after_the_block_do_not_count():
    q, k, v, q_pos, k_pos, sinks, out = _check(17, 16, 2, 64, None, True, "cached", seed=10)
    k[:, :, int(q_pos[-1]) + 1:] = 7.0
    v[:, :, int(q_pos[-1]) + 1:] = -3.0
    assert torch.equal(attention_prefill.attention(q, k, v, q_pos, k_pos, 64 ** -0.5, None, sinks), out)


@pytest.mark.parametrize("window,with_sinks", [(None, True), (128, True), (4, False)])
def test_the_decode_kernel_with_the_shared_mask_matches_the_float64_oracle(window, with_sinks, monkeypatch):
    """One token at position 300 over a 340-slot cache, split over 4 programs per key/value head
    (6 blocks of 64 slots: 2, 2, 2 and none)."""
    monkeypatch.setattr(attention_decode, "_sm_count", lambda device: 8)
    gen = torch.Generator().manual_seed(11 + (window or 0))
    q = torch.randn(2, 1, 16, 64, generator=gen).to(torch.bfloat16)
    k = (torch.randn(2, 2, 340, 64, generator=gen) * 2).to(torch.bfloat16)
    v = torch.randn(2, 2, 340, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(16, generator=gen) * 1.5 if with_sinks else None
    q_pos, k_pos = torch.tensor([300]), torch.arange(340)
    out = attention_decode.attention(q, k, v, q_pos, k_pos, 64 ** -0.5, window, sinks)
    assert out.shape == (2, 1, 16, 64) and torch.isfinite(out).all()
    assert _rel(out, _oracle(q, k, v, q_pos, k_pos, window, sinks)) < TOLERANCE

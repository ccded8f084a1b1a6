"""The Triton FP8 linear kernels in Triton's CPU interpreter against the float64 oracle (tests/runtime/helpers_fp8_linear.py).

Runs only with Triton installed and `TRITON_INTERPRET=1` (e.g. `PYTHONPATH=/path/to/triton TRITON_INTERPRET=1
python -m pytest tests/runtime/test_fp8_linear_triton_interpreter.py`); the GPU test is tests/gpu/test_fp8_linear.py.
Odd row counts (1, 3, 17, 130), K and N multiples of 128 and not, each tile path (decode tiles with
and without split-K, 128-row tiles): the activation codes and scales equal the oracle's bit for bit, and
the product is the oracle's within fp32 summation (relative 1e-6).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.runtime.helpers_fp8_linear import act_1x128, quantize_blocks, reference, rel

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs with TRITON_INTERPRET=1", allow_module_level=True)

from runtime.kernels import triton_fp8_linear as L  # noqa: E402

# (M, K, N, config or None for the plan on 132 SMs)
CASES = [
    (1, 256, 384, None),                       # decode plan: split-K over 2 K-blocks
    (3, 384, 200, (16, 64, 4, 2, 0, 2)),       # N not a multiple of 128, uneven split (2 + 1 blocks)
    (17, 320, 256, (32, 64, 4, 2, 0, 1)),      # K not a multiple of 128 (2.5 blocks)
    (130, 256, 128, (64, 128, 4, 2, 2, 1)),    # three row tiles, grouped order
    (130, 64, 192, None),                      # prefill plan (128-row tiles), K below one block
]


@pytest.mark.parametrize("m,k,n,cfg", CASES, ids=lambda v: str(v))
def test_the_kernel_matches_the_float64_oracle(m, k, n, cfg):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]   # rows of very different scales
    codes, scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05)
    y = L.fp8_block_linear(x, codes, scale, cfg)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel(y, reference(x, codes, scale)) <= 1e-6


def test_activation_codes_and_scales_are_the_oracle_s_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(33, 300, generator=gen) * torch.logspace(-8, 3, 33)[:, None]
    x[1, :128] = 0   # an all-zero group: the amax floor
    kb = 3
    q = torch.empty(33, 300, dtype=torch.float8_e4m3fn)
    s = torch.empty(33, kb)
    L.quant_act[(5, kb)](x, q, s, 33, 300, kb, ROWS=8)
    values = (q.double().view(33, -1)[:, :300])
    scales = s.double().repeat_interleave(128, 1)[:, :300]
    assert torch.equal(values * scales, act_1x128(x))


def test_bf16_inputs_give_bf16_outputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2048, generator=gen).to(torch.bfloat16)
    codes, scale = quantize_blocks(torch.randn(512, 2048, generator=gen))
    y = L.fp8_block_linear(x, codes, scale)
    assert y.dtype == torch.bfloat16
    # the output rounded to bf16 once, to nearest even: bf16's own error (measured 1.7e-3), no more
    assert rel(y, reference(x, codes, scale)) <= 2.5e-3


def test_the_experts_gemm2_sharing_the_k_loop_still_computes_each_expert_s_product():
    """runtime/kernels/triton_grouped.gemm2 runs the same `block_scaled_dot` over routed token tiles: expert 0
    owns sorted rows 0-4, expert 1 rows 5-20, and a third tile past num_tiles does nothing."""
    from runtime.kernels import triton_grouped as T

    gen = torch.Generator().manual_seed(11)
    hidden, inter, rows = 256, 384, 21
    w, ws = zip(*(quantize_blocks(torch.randn(hidden, inter, generator=gen) * 0.05) for _ in range(2)))
    x = torch.randn(rows, inter, generator=gen)
    h = torch.empty(rows, inter, dtype=torch.float8_e4m3fn)
    hs = torch.empty(rows, 3)
    L.quant_act[(3, 3)](x, h, hs, rows, inter, 3, ROWS=8)
    offs = torch.tensor([0, 5, 21], dtype=torch.int32)
    tile_expert, tile_row = torch.tensor([0, 1, 0], dtype=torch.int32), torch.tensor([0, 5, 0], dtype=torch.int32)
    y = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    T.launch_gemm2(h, hs, torch.stack(w), torch.stack(ws), offs, tile_expert, tile_row, torch.tensor([2], dtype=torch.int32),
                   y, hidden=hidden, inter=inter, max_tiles=3, fp8=True, cfg=(16, 128, 128, 4, 2))
    expected = torch.cat([reference(x[:5], w[0], ws[0]), reference(x[5:], w[1], ws[1])])
    assert rel(y, expected) <= 2.5e-3

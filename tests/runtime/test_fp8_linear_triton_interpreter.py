"""The Triton W8A16 linear (and the experts' FP8 gemm2) in Triton's CPU interpreter against the float64 oracle (tests/runtime/helpers_fp8_linear.py).

Runs only with Triton installed and `TRITON_INTERPRET=1` (e.g. `PYTHONPATH=/path/to/triton TRITON_INTERPRET=1
python -m pytest tests/runtime/test_fp8_linear_triton_interpreter.py`); the GPU test is tests/gpu/test_fp8_linear.py.
Decode-sized row counts (1, 3, 17, 64), K and N multiples of 128 and not, with and without split-K, fp16
activations: the output is the oracle's (the dequantized weight rounded to the activation dtype, the product
in float64) within the one rounding of the output (fp16: 4e-4 relative). bf16, the builds' dtype, runs the
same kernel with other rounding constants; it is the GPU test's (tests/gpu/test_fp8_linear.py), because the
interpreter's bf16 `tl.dot` multiplies raw bit patterns (triton 3.9: a bf16 tile times its own transpose
gives ~1e11).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.runtime.helpers_fp8_linear import quantize_blocks, reference, rel, weight_blocks

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs with TRITON_INTERPRET=1", allow_module_level=True)

from runtime.kernels import triton_fp8_linear as L  # noqa: E402

# (M, K, N, config or None for the plan on 132 SMs)
CASES = [
    (1, 256, 384, None),                       # decode plan: split-K over 2 K-blocks
    (3, 384, 200, (16, 64, 4, 2, 0, 2)),       # N not a multiple of 128, uneven split (2 + 1 blocks)
    (17, 320, 256, (32, 64, 4, 2, 0, 1)),      # K not a multiple of 128 (2.5 blocks)
    (64, 256, 192, (64, 64, 4, 2, 2, 1)),      # the largest decode tile, grouped order
]


@pytest.mark.parametrize("m,k,n,cfg", CASES, ids=lambda v: str(v))
def test_the_kernel_matches_the_float64_oracle(m, k, n, cfg):
    dtype = torch.float16
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m)[:, None]).to(dtype)   # rows of different scales
    codes, scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05)
    y = L.fp8_block_linear(x, codes, scale, cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel(y, reference(x, codes, scale)) <= 4e-4


def test_a_call_above_the_decode_rows_is_refused():
    with pytest.raises(ValueError) as e:
        L.plan(65, 128, 128, 132)
    assert str(e.value) == "the W8A16 kernel streams weights for at most 64 rows, got 65"


def test_the_experts_gemm2_still_computes_each_expert_s_product():
    """runtime/kernels/triton_grouped.gemm2 over routed token tiles with FP8 activations (1x128 groups):
    expert 0 owns sorted rows 0-4, expert 1 rows 5-20, and a third tile past num_tiles does nothing."""
    from runtime.formats import fp8
    from runtime.kernels import triton_grouped as T

    gen = torch.Generator().manual_seed(11)
    hidden, inter, rows = 256, 384, 21
    w, ws = zip(*(quantize_blocks(torch.randn(hidden, inter, generator=gen) * 0.05) for _ in range(2)))
    h, hs = fp8.quantize_act_groups(torch.randn(rows, inter, generator=gen))
    offs = torch.tensor([0, 5, 21], dtype=torch.int32)
    tile_expert, tile_row = torch.tensor([0, 1, 0], dtype=torch.int32), torch.tensor([0, 5, 0], dtype=torch.int32)
    y = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    T.launch_gemm2(h, hs.contiguous(), torch.stack(w), torch.stack(ws), offs, tile_expert, tile_row,
                   torch.tensor([2], dtype=torch.int32), y, hidden=hidden, inter=inter, max_tiles=3, fp8=True,
                   cfg=(16, 128, 128, 4, 2))
    a = fp8.dequantize_act_groups(h, hs).double()
    expected = torch.cat([a[:5] @ weight_blocks(w[0].double(), ws[0]).T, a[5:] @ weight_blocks(w[1].double(), ws[1]).T])
    assert rel(y, expected) <= 2.5e-3

"""The TRITON MXFP4 (W4A16) grouped GEMMs in Triton's CPU interpreter against a float64 oracle of the dequantized weights.

Runs only with Triton installed and `TRITON_INTERPRET=1` (e.g. `PYTHONPATH=/path/to/triton TRITON_INTERPRET=1
python -m pytest tests/runtime/test_w4_grouped_triton_interpreter.py`); the GPU test is tests/gpu/test_triton_experts.py.
The weights are the product's: random MXFP4 checkpoint tensors loaded by the CUPY w4a16_mxfp4 class on the
CPU (gate/up interleaved, FP4 bits in its `BF16_WORD` order), decoded by the kernels' `mxfp4_dequant`.
The routing lists are moe_align's (rows counting-sorted by expert, tiles of BM rows), built here in torch.
Sizes that are not multiples of the output blocks, 64-300 tokens, hot and empty experts, biases, each
activation (swiglu_oai with gpt-oss's alpha and limit): every output element within bf16's rounding
(2^-8 relative) plus fp32 summation (1e-4 of the output's RMS) of the oracle.
"""
from __future__ import annotations

import os

import pytest
import torch

from runtime.experts.base import DictExpertSource, ExpertParallel, MoeShape
from runtime.experts.cupy_mma import CupyMmaW4a16Mxfp4Experts
from runtime.formats import mxfp4
from runtime.kernels.layouts import relayout_fp4
from tests.runtime.helpers_experts import _activation64, dequantize64, make_expert_tensors, random_routing

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs with TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from runtime.kernels import triton_grouped as T  # noqa: E402

ACT = {"silu_glu": 0, "swiglu_oai": 1, "relu2": 2}


@pytest.fixture(autouse=True)
def _bf16_dot(monkeypatch):
    """The interpreter (3.9) multiplies bf16 dot operands as their raw uint16 bits; widen them to fp32 first
    (exact), as the tensor cores read them. Other dtypes go through its own dot unchanged."""
    import numpy as np
    from triton.runtime import interpreter as I

    own = I.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            wide = [I.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32) for t in (a, b)]
            return own(self, *wide, d, *args)
        return own(self, a, b, d, *args)

    monkeypatch.setattr(I.InterpreterBuilder, "create_dot", create_dot)


def _route(ids, n_local, bm):
    """moe_align's lists: (max_tiles, offs, sorted_pair, tile_expert, tile_row, num_tiles); one spare tile past
    num_tiles points at expert 0 (the kernels must skip it)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    sorted_pair = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=n_local)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    tiles = [(e, int(offs[e]) + j * bm) for e in range(n_local) for j in range(-(-int(counts[e]) // bm))]
    max_tiles = pairs // bm + min(n_local, pairs)
    assert len(tiles) < max_tiles
    pad = [(0, 0)] * (max_tiles - len(tiles))
    tile_expert, tile_row = (torch.tensor(v, dtype=torch.int32) for v in zip(*(tiles + pad)))
    return max_tiles, offs, sorted_pair, tile_expert, tile_row, torch.tensor([len(tiles)], dtype=torch.int32)


def _layer(spec, seed):
    tensors = make_expert_tensors(spec, "w4a16_mxfp4", seed=seed, weight_std=3.0 if spec.expert_bias else 1.0)
    module = CupyMmaW4a16Mxfp4Experts(spec, ExpertParallel(), device="cpu")
    module.load_weights(DictExpertSource(tensors))
    return module, tensors, dequantize64(tensors, spec, "w4a16_mxfp4")


def _assert_close(actual, expected):
    actual, expected = actual.double(), expected.double()
    floor = 1e-4 * expected.pow(2).mean().sqrt()
    bad = (actual - expected).abs() > 2.0 ** -8 * expected.abs() + floor
    assert not actual.isnan().any() and not bad.any(), \
        f"{int(bad.sum())} of {bad.numel()} elements off, worst {(actual - expected).abs().max().item():.3g}"


# (hidden, intermediate, experts, tokens, top_k, activation, bias, hot experts or None, gemm1 cfg, gemm2 cfg)
CASES = [
    # the classes' planned tiles; H = 192 leaves gemm2's second output block half full
    (192, 192, 8, 64, 4, "swiglu_oai", True, None, (128, 64, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8)),
    # 128-channel gemm1 blocks over I = 192 and H = 320: partial blocks in both GEMMs
    (320, 192, 8, 300, 2, "silu_glu", False, None, (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8)),
    # every token on experts 1 and 6 (several tiles each), the other six empty; BK = 32: one scale a block
    (128, 128, 8, 150, 2, "swiglu_oai", True, [1, 6], (32, 32, 32, 4, 2), (32, 64, 32, 4, 2)),
    # not gated, one output block of 128 over I = 64
    (192, 64, 4, 97, 1, "relu2", True, None, (16, 128, 64, 4, 2, 2), (16, 64, 64, 4, 2, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[3]}tok-{c[5]}")
def test_grouped_gemms_match_the_float64_oracle(case):
    hsize, inter, n, tokens, top_k, act, bias, hot, cfg1, cfg2 = case
    spec = MoeShape(hsize, inter, n, top_k, act, expert_bias=bias)
    module, tensors, w64 = _layer(spec, seed=tokens + inter)
    ids, _ = random_routing(tokens, spec, seed=tokens, experts=hot)
    gen = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, hsize, generator=gen).bfloat16()
    max_tiles, offs, sorted_pair, tile_expert, tile_row, num_tiles = _route(ids, n, cfg1[0])
    pairs = tokens * top_k

    h = torch.full((pairs, inter), float("nan"), dtype=torch.bfloat16)
    T.launch_gemm1(x, None, module.w13, module.s13, module.b13 if bias else None, sorted_pair, offs, tile_expert,
                   tile_row, num_tiles, h, None, hidden=hsize, inter=inter, top_k=top_k, max_tiles=max_tiles,
                   alpha=spec.swiglu_alpha, limit=spec.swiglu_limit, fp8=False, gated=spec.gated, act=ACT[act],
                   cfg=cfg1, w4=True)
    expert_of_row = torch.sort(ids.reshape(-1), stable=True).values
    token_of_row = sorted_pair.long() // top_k
    x64 = x.double()
    expected_h = torch.empty(pairs, inter, dtype=torch.float64)
    for e in range(n):
        rows = (expert_of_row == e).nonzero().reshape(-1)
        lin = {p: x64[token_of_row[rows]] @ w64[e, p].T + (tensors[e, p, "bias"].double() if bias else 0)
               for p in ("gate", "up") if (e, p) in w64}
        expected_h[rows] = _activation64(spec, lin.get("gate"), lin["up"])
    _assert_close(h, expected_h)

    # gemm2 from fresh random bf16 rows (its own input, not gemm1's output)
    h2 = torch.randn(pairs, inter, generator=gen).bfloat16()
    y = torch.full((pairs, hsize), float("nan"), dtype=torch.bfloat16)
    T.launch_gemm2(h2, None, module.w2, module.s2, offs, tile_expert, tile_row, num_tiles, y, hidden=hsize,
                   inter=inter, max_tiles=max_tiles, fp8=False, cfg=cfg2, w4=True)
    expected_y = torch.empty(pairs, hsize, dtype=torch.float64)
    for e in range(n):
        rows = (expert_of_row == e).nonzero().reshape(-1)
        expected_y[rows] = h2[rows].double() @ w64[e, "down"].T
    _assert_close(y, expected_y)


@triton.jit
def _decode(w_ptr, s_ptr, out_ptr, K, R: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, R).to(tl.int64)
    for k0 in range(0, K, BK):
        v = T.mxfp4_dequant(w_ptr, s_ptr, rows, k0, K, BK)
        tl.store(out_ptr + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :], v)


def test_dequant_is_exact_for_every_code_and_scale():
    """Every E2M1 code at every position of a word, under E8M0 scales 2^-125 .. 2^127 (bytes 2..254; byte 0
    reads as 0 instead of 2^-127 * code, byte 255 is NaN, byte 1 makes 0.5 a bf16 subnormal, which the
    interpreter's cast flushes): bit-equal to runtime/formats' dequantizer, infinities included."""
    rows, k = 16, 256
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    codes[1, :16] = torch.arange(16, dtype=torch.uint8).flip(0)
    scales = torch.randint(2, 255, (rows, k // 32), generator=gen, dtype=torch.uint8)
    scales[0, :4] = torch.tensor([2, 127, 200, 254], dtype=torch.uint8)
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    out = torch.empty(rows, k, dtype=torch.bfloat16)
    _decode[(1,)](relayout_fp4(packed, "bf16").view(torch.int32), scales, out, k, R=rows, BK=64)
    expected = mxfp4.dequantize_mxfp4(packed, scales)
    assert torch.equal(out.float(), expected) and torch.equal(expected.bfloat16().float(), expected)

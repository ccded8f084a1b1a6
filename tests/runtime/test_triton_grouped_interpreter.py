"""The TRITON experts' bf16, MXFP4, NVFP4 and W4A8 grouped GEMMs (runtime/kernels/triton_grouped.py) in Triton's CPU interpreter
against a float64 oracle, with every tile configuration the classes plan with and a small one.

Runs only with Triton installed and `TRITON_INTERPRET=1` (e.g. `PYTHONPATH=/path/to/triton TRITON_INTERPRET=1
python -m pytest tests/runtime/test_triton_grouped_interpreter.py`); on the GPU, tests/gpu/test_triton_experts.py
runs the whole op. The weights are the checkpoint's, laid out by the product's own loader code
(`cupy_layout.convert`: gate/up interleaved per 8 rows, FP4 bits re-laid); the routing arrays are those
`moe_align` documents (pairs stably sorted by expert, tiles of at most BM rows), built here in torch since
moe_align is a CUDA kernel.
Judged per routed pair: GEMM1's bf16 intermediate against the float64 activation of the float64 products (one
bf16 rounding, which the interpreter truncates rather than rounds), GEMM2's bf16 rows against the float64
product of that intermediate. Sizes are multiples of the K-blocks but not of the output blocks (partial tiles),
with hot experts and experts that get no rows. The FP4 weights are decoded in the kernels (NVFP4's per-expert
scales applied in their epilogues); the oracle takes them straight from codes and scales in float64. W4A8's
GEMMs take E4M3 codes with a scale per row as its classes' `quant_fp8_rows` writes them: `quantize_act_per_token`'s
codes, each 64-chunk in the stored K order (tests/gpu/test_cupy_experts.py holds the kernel to those bits); the oracle
multiplies the same codes, in canonical order, and scales. FP8 is not covered: the interpreter has no E4M3 dot.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs with TRITON_INTERPRET=1", allow_module_level=True)

from runtime.experts.base import MoeShape  # noqa: E402
from runtime.experts.cupy_layout import convert  # noqa: E402
from runtime.experts.triton_grouped import (_ACT, TritonWgmmaBf16Experts,  # noqa: E402
                                            TritonWgmmaW4a8Mxfp4Fp8Experts, TritonWgmmaW4a16Mxfp4Experts,
                                            TritonWgmmaW4a16Nvfp4Experts)
from runtime.formats.fp8 import quantize_act_per_token  # noqa: E402
from runtime.kernels import triton_grouped as T  # noqa: E402
from runtime.kernels.layouts import w4a8_stored_order  # noqa: E402
from tests.runtime.helpers_experts import (_activation64, assert_rel_close, dequantize64,  # noqa: E402
                                          make_expert_tensors, random_hidden, random_routing)
from tests.runtime.helpers_triton import bf16_dot  # noqa: E402,F401  (autouse fixture)

SMALL = ((16, 64, 64, 4, 2), (16, 64, 64, 4, 2))
CASES = ([("bf16", cfg) for _, cfg in TritonWgmmaBf16Experts.CONFIGS] + [("bf16", SMALL)]
         # the planned MXFP4 tiles with the unpacked decode: the packed one is inline PTX, which the interpreter
         # cannot run (tests/gpu/test_triton_experts.py asserts both give the same bits)
         + [(cls.FORMAT, tuple(c[:6] for c in cfg))
            for cls in (TritonWgmmaW4a16Mxfp4Experts, TritonWgmmaW4a16Nvfp4Experts, TritonWgmmaW4a8Mxfp4Fp8Experts)
            for _, cfg in cls.CONFIGS]
         + [("w4a16_mxfp4", SMALL), ("w4a16_nvfp4", SMALL), ("w4a8_mxfp4_fp8", SMALL)])


def _routing(ids: torch.Tensor, experts: int, bm: int):
    """What `moe_align` hands the GEMMs: pairs sorted by expert, expert offsets, tiles of at most `bm` rows."""
    flat = ids.reshape(-1)
    sorted_pair = torch.argsort(flat, stable=True).int()
    counts = torch.bincount(flat, minlength=experts)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    tiles = [(e, int(offs[e]) + j * bm) for e in range(experts) for j in range(-(-int(counts[e]) // bm))]
    max_tiles = flat.numel() // bm + min(experts, flat.numel())
    tile_expert = torch.zeros(max_tiles, dtype=torch.int32)
    tile_row = torch.zeros(max_tiles, dtype=torch.int32)
    tile_expert[:len(tiles)] = torch.tensor([e for e, _ in tiles], dtype=torch.int32)
    tile_row[:len(tiles)] = torch.tensor([r for _, r in tiles], dtype=torch.int32)
    return sorted_pair, offs, tile_expert, tile_row, torch.tensor([len(tiles)], dtype=torch.int32), max_tiles


def _per_row_fp8(rows):
    """W4A8's GEMM input: (E4M3 codes in the stored K order, fp32 scale per row) and the float64 values they stand
    for, in canonical order."""
    codes, scale = quantize_act_per_token(rows)
    stored = w4a8_stored_order(codes.view(torch.uint8))
    return stored.view(torch.float8_e4m3fn), scale.reshape(-1), codes.double() * scale.double()


def _oracle(spec, fmt, tensors, hidden, ids, sorted_pair, h_fed=None):
    """float64 intermediate and down rows of every routed pair, in sorted order; the down rows of `h_fed` (float64,
    sorted order) where given, else of the oracle's own intermediate rounded to bf16."""
    weights = dequantize64(tensors, spec, fmt)
    rows_h, rows_y = [], []
    for row, p in enumerate(sorted_pair.tolist()):
        t, e = p // spec.top_k, int(ids.reshape(-1)[p])
        x = hidden[t].double()

        def linear(a, proj):
            out = a @ weights[e, proj].T
            return out + tensors[e, proj, "bias"].double() if spec.expert_bias and proj != "down" else out

        h = _activation64(spec, linear(x, "gate") if spec.gated else None, linear(x, "up"))
        rows_h.append(h)
        rows_y.append((h.to(torch.bfloat16).double() if h_fed is None else h_fed[row]) @ weights[e, "down"].T)
    return torch.stack(rows_h), torch.stack(rows_y)


@pytest.mark.parametrize("fmt, cfg", CASES, ids=lambda c: c if isinstance(c, str) else f"BM{c[0][0]}")
@pytest.mark.parametrize("activation", ["silu_glu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("tokens, experts", [(37, None), (40, [1, 4, 6])])
def test_grouped_gemms_match_float64(fmt, cfg, activation, tokens, experts):
    bias = activation == "swiglu_oai"
    spec = MoeShape(320, 192, 8, 3, activation, expert_bias=bias)
    seed = 7 * tokens + len(activation) + len(fmt)
    tensors = make_expert_tensors(spec, fmt, seed=seed, weight_std=3.0 if bias else 1.0)
    buffers = convert(fmt, spec, range(spec.num_experts), tensors, "cpu")
    ids, _ = random_routing(tokens, spec, seed=seed + 1, experts=experts)
    hidden = random_hidden(tokens, spec, seed=seed + 2)
    (cfg1, cfg2), (h_dim, i_dim) = cfg, (spec.hidden_size, spec.intermediate_size)
    sorted_pair, offs, tile_expert, tile_row, num_tiles, max_tiles = _routing(ids, spec.num_experts, cfg1[0])
    pairs = ids.numel()
    w4a8 = fmt == "w4a8_mxfp4_fp8"
    x, xs, x64 = _per_row_fp8(hidden) if w4a8 else (hidden, None, hidden)
    h = torch.full((pairs, i_dim), float("nan"), dtype=torch.bfloat16)
    T.launch_gemm1(x, xs, buffers["w13"], buffers.get("s13"), buffers.get("g13"), buffers.get("b13"),
                   sorted_pair, offs, tile_expert, tile_row, num_tiles, h, None, hidden=h_dim, inter=i_dim,
                   top_k=spec.top_k, max_tiles=max_tiles, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit, fmt=fmt,
                   gated=spec.gated, act=_ACT[activation], cfg=cfg1)
    y = torch.full((pairs, h_dim), float("nan"), dtype=torch.bfloat16)
    h_in, hs, h64 = _per_row_fp8(h) if w4a8 else (h, None, None)
    T.launch_gemm2(h_in, hs, buffers["w2"], buffers.get("s2"), buffers.get("g2"), offs, tile_expert, tile_row,
                   num_tiles, y, hidden=h_dim, inter=i_dim, max_tiles=max_tiles, fmt=fmt, cfg=cfg2)
    ref_h, ref_y = _oracle(spec, fmt, tensors, x64, ids, sorted_pair, h64)
    assert not h.isnan().any() and not y.isnan().any()
    assert_rel_close(h, ref_h, 1e-2, 2.0 ** -6)
    assert_rel_close(y, ref_y, 1e-2, 2.0 ** -5)

"""Triton decode of packed FP4 weight blocks (MXFP4, NVFP4, and MXFP4 in W4A8's layout) into exact bf16 blocks, for
the grouped GEMMs of triton_grouped.py (imported with them, only where Triton is)."""
from __future__ import annotations

import triton
import triton.language as tl

from .layouts import BF16_WORD_MAG, BF16_WORD_SIGN

_TWO_126 = tl.constexpr(2.0 ** 126)
_TWO_110 = tl.constexpr(2.0 ** 110)
# W4 formats: 0 none, 1 MXFP4 (E8M0 scale per 32 elements), 2 NVFP4 (E4M3 scale per 16, fp32 scale per expert),
# 3 W4A8 (MXFP4 in the E4M3_WORD layout, FP8 activations with a scale per token)
W4_FORMATS = {"w4a16_mxfp4": 1, "w4a16_nvfp4": 2, "w4a8_mxfp4_fp8": 3}
_MAG, _SIGN = tl.constexpr(BF16_WORD_MAG), tl.constexpr(BF16_WORD_SIGN)


@triton.jit
def fp4_pair(p, f):
    """The two bf16 weights of a bf16x2 pair `p` holding E2M1 values * 2^-126, times the scale `f`: back to the
    E2M1 value first (exact), as 2^126 * 2^(s - 127) in one factor would overflow fp32 for scale bytes above 128."""
    lo = (p << 16).to(tl.float32, bitcast=True) * _TWO_126
    hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True) * _TWO_126
    return (lo * f).to(tl.bfloat16), (hi * f).to(tl.bfloat16)


@triton.jit
def fp4_pair_packed(p, mul1, mul2):
    """`fp4_pair` in two fma.rn.bf16x2 on the packed pair (moe_kernels.cu's decode): times the bf16x2 factors
    mul1 and mul2 whose product is 2^126 times the block scale (two, as bf16 stops at 2^127): for MXFP4
    2^(min(s, 128) - 1) and 2^(max(s, 128) - 128), for NVFP4 the E4M3 scale * 2^110 and 2^16. Exact: E2M1 values
    times scales of at most 4 significant bits, subnormals included. Inline PTX: GPU only (the interpreter runs
    `fp4_pair`). GEMM1's K loop 398 -> 334 PTX instructions (offline, Triton 3.6, sm_90a, MXFP4)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, z; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, $3, z; fma.rn.bf16x2 t, t, $4, z; "
        "mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r", [p, mul1, mul2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def fp4_block(w_desc, ws_ptr, w_row0, wrows, k0, K, BK: tl.constexpr, PACKED: tl.constexpr, W4: tl.constexpr):
    """bf16 weights [rows, BK] of the global weight rows `wrows` (from descriptor row w_row0), K from k0, decoded
    from packed FP4 words (layouts.BF16_WORD, as moe_kernels.cu's fp4_to_bf16x8 does; W4 3: layouts.E4M3_WORD, in its
    stored K order: words of a chunk interleaved by halves, the order quant_fp8_rows writes W4A8's activations in)
    times their block scales (W4 1 and 3: E8M0 per 32 elements; 2: E4M3 per 16, the
    products exact in bf16: 2 and 4 significant bits) (PACKED: in bf16x2 pairs, `fp4_pair_packed`)."""
    # [rows / 16, 16, 8] words: the 16 x 64 tiles of the rows at chunk k0 / 64 (BK == 64)
    x = w_desc.load([w_row0 // 16, k0 // 4, 0])
    x = tl.reshape(x, [x.shape[0] * 16, BK // 8]).to(tl.uint32, bitcast=True)
    word = k0 // 8 + tl.arange(0, BK // 8)
    # the scales' 16 x 64 tiles (layouts.tile_rows: SB bytes a row, one per 64 / SB elements): the scale of word w
    # (8 elements) of chunk k0 / 64 is byte (w % 8) // (8 / SB) of its row; W4A8's stored word w holds canonical
    # word (0, 4, 1, 5, 2, 6, 3, 7)[w % 8], of MX block (w % 8) % 2
    SB: tl.constexpr = 4 if W4 == 2 else 2
    tile = (wrows // 16).to(tl.int64) * (K // 64) + k0 // 64
    block = (word % 8) % 2 if W4 == 3 else word % 8 // (8 // SB)
    s = tl.load(ws_ptr + (tile * 16 * SB + (wrows % 16) * SB)[:, None] + block[None, :])
    s = s.to(tl.uint8, bitcast=True)
    if W4 == 3:
        # layouts.E4M3_WORD: element i's magnitude at bits 8(i % 4) + 2 (i < 4) or + 5, its sign at 8(i % 4) or + 1;
        # pairs (0, 2), (1, 3), (4, 6), (5, 7) are 16 bits apart, so one shift each puts them on the bf16 fields
        p0 = ((x << 4) & _MAG) | ((x << 15) & _SIGN)
        p1 = ((x >> 4) & _MAG) | ((x << 7) & _SIGN)
        p2 = ((x << 1) & _MAG) | ((x << 14) & _SIGN)
        p3 = ((x >> 7) & _MAG) | ((x << 6) & _SIGN)
    else:
        p0 = x & (_MAG | _SIGN)
        p1 = ((x >> 3) & _MAG) | ((x << 15) & _SIGN)
        p2 = ((x >> 6) & _MAG) | ((x << 14) & _SIGN)
        p3 = ((x << 3) & _MAG) | ((x << 13) & _SIGN)
    if PACKED:
        if W4 != 2:
            # bf16x2 exponent fields min(s, 128) + 126 and max(s, 128) - 1, in both halves
            s = s.to(tl.uint32)
            mul1 = ((tl.minimum(s, 128) + 126) << 7) * 0x10001
            mul2 = ((tl.maximum(s, 128) - 1) << 7) * 0x10001
        else:
            # the E4M3 scale * 2^110 (exact in bf16; 2^126 would pass bf16's top at scales of 2 and above), then 2^16
            mul1 = (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _TWO_110).to(tl.bfloat16)
            mul1 = mul1.to(tl.uint16, bitcast=True).to(tl.uint32) * 0x10001
            mul2 = tl.full(s.shape, 0x47804780, tl.uint32)   # bf16x2 2^16
        e0, e1 = fp4_pair_packed(p0, mul1, mul2)
        e2, e3 = fp4_pair_packed(p1, mul1, mul2)
        e4, e5 = fp4_pair_packed(p2, mul1, mul2)
        e6, e7 = fp4_pair_packed(p3, mul1, mul2)
    else:
        if W4 != 2:
            # 2^(s - 127); byte 0 is 2^-127, an fp32 subnormal
            s = s.to(tl.uint32)
            f = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        else:
            f = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        e0, e1 = fp4_pair(p0, f)
        e2, e3 = fp4_pair(p1, f)
        e4, e5 = fp4_pair(p2, f)
        e6, e7 = fp4_pair(p3, f)
    if W4 == 3:   # its pairs are elements (0, 2), (1, 3), (4, 6), (5, 7)
        e1, e2, e5, e6 = e2, e1, e6, e5
    # element 8w + i of the block is e_i of (stored) word w
    evens = tl.interleave(tl.interleave(e0, e4), tl.interleave(e2, e6))
    odds = tl.interleave(tl.interleave(e1, e5), tl.interleave(e3, e7))
    return tl.interleave(evens, odds)

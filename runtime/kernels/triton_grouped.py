"""Triton grouped GEMMs of the TRITON experts (tl.dot: wgmma on sm_90, E4M3 at the FP8 rate).

Imported only when a TRITON experts class runs on a GPU (Triton is absent on CPU-only hosts).
Both kernels walk (token tile, output block) work listed by the CUPY `moe_align` kernel: tile t
covers sorted rows tile_row[t] .. min(tile_row[t] + BM, offs[e + 1]) of local expert
tile_expert[t]; programs past num_tiles[0] return at once, so the grid is fixed for a CUDA graph.
The tile index runs fastest, so the programs alive together read the same weight block of each
expert and the L2 serves it to that expert's other tiles.

`gemm1`: gate/up with the token rows gathered in the loads (no gather pass), bias, activation, the
bf16 rounding of the intermediate and, for FP8, its 1x128 quantization (the output block is one
128-channel group) in the epilogue. `gemm2`: down projection into bf16 rows in sorted order, for
the CUPY `moe_combine`. FP8: one 128x128 weight block scale and one 1x128 activation scale per
K-block, promoted into the fp32 accumulator after each block's product (as DeepSeek's recipe does).
MXFP4 and NVFP4 (W4): the packed words (runtime/kernels/layouts.BF16_WORD bit layout, 8 elements a word, rows
tiled by 16 x 64: layouts.tile_rows) come through TMA, 64 K elements a step, and are decoded with their block
scales (E8M0 per 32, or E4M3 per 16) into an exact bf16 block in registers, the dot's first operand (wgmma reads
it from registers; the accumulator is transposed once after the K loop); NVFP4's per-expert fp32 scale multiplies
the accumulator in the epilogue. Activations stay bf16. W4A8 (MXFP4 weights in the CUPY w4a8 layout,
layouts.E4M3_WORD, FP8 activations with a scale per token): the same decode from that layout's bits, in its
stored K order (words of a chunk interleaved by halves), which is the order the CUPY `quant_fp8_rows` writes the
activations' E4M3 codes in (per-token mode), so they are loaded as they lie and widened to bf16 (exact), their
per-token scales applied in the epilogue. The FP4 decode: fp4_blocks.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .fp4_blocks import W4_FORMATS, fp4_block

ACT_SILU_GLU, ACT_SWIGLU_OAI, ACT_RELU2 = 0, 1, 2
_SCALE_BLOCK = tl.constexpr(128)


@triton.jit
def _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr, lanes):
    """(expert, rows clamped into the tile, row mask) of a live token tile; `lanes` 0 .. BM - 1 (an arange: gluon_w4
    passes its own, laid out for its MMA)."""
    e = tl.load(tile_expert_ptr + pid_m)
    r0 = tl.load(tile_row_ptr + pid_m)
    r1 = tl.load(offs_ptr + e + 1)
    rows = r0 + lanes
    # rows past the tile's end read its last row (a valid address): loads need no mask
    return e.to(tl.int64), tl.minimum(rows, r1 - 1), rows < r1


@triton.jit
def _program(pid, max_tiles, num_n, GROUP_M: tl.constexpr):
    """(token tile, output block) of program `pid`: the tile fastest, over GROUP_M tiles at a time
    (all tiles when GROUP_M == 0), so the programs alive together share weight and row blocks."""
    if GROUP_M == 0:
        return pid % max_tiles, pid // max_tiles
    in_group = GROUP_M * num_n
    first = (pid // in_group) * GROUP_M
    size = tl.minimum(max_tiles - first, GROUP_M)
    return first + (pid % in_group) % size, (pid % in_group) // size


@triton.jit
def _activate(g, u, ACT: tl.constexpr, alpha, limit):
    """The intermediate of gate g and up u (fp32): silu(g) * u, gpt-oss's clamped swiglu, or relu(u)^2 (also the
    epilogue of gluon_w4.gemm1, which calls it, so both round alike)."""
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    else:
        r = tl.maximum(u, 0.0)
        h = r * r
    return h


@triton.jit
def _gate_up(acc, ROWS: tl.constexpr, C: tl.constexpr):
    """(gate, up) [ROWS, C] of an accumulator [ROWS, 2C] whose columns are w13 rows interleaved by 8
    (layouts.interleave_gate_up: rows 16b + i gate, 16b + 8 + i up, channel 8b + i); gluon_fp8 calls it too."""
    g, u = tl.split(tl.permute(tl.reshape(acc, [ROWS, C // 8, 2, 8]), [0, 1, 3, 2]))
    return tl.reshape(g, [ROWS, C]), tl.reshape(u, [ROWS, C])


@triton.jit
def _fp8_scale(amax):
    """The 1x128 group scale of an intermediate row whose largest magnitude is `amax` (E4M3's 448 at the top)."""
    return tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)


@triton.jit
def _fp8_codes(hf, scale):
    """hf / scale, clamped to the E4M3 range, as E4M3 codes (gluon_fp8's epilogue too, so both quantize alike)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(hf, scale), -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def gemm1(x_ptr, xs_ptr, w_desc, ws_ptr, g_ptr, bias_ptr, sorted_pair_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
          num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, max_tiles, alpha, limit,
          FP8: tl.constexpr, W4: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          PACKED: tl.constexpr):
    # one dot over BNW consecutive w13 rows: gate and up interleaved in blocks of 8
    # (runtime/kernels/layouts.interleave_gate_up), split in the epilogue
    PLANES: tl.constexpr = 2 if GATED else 1
    BNW: tl.constexpr = BN * PLANES
    pid_m, pid_n = _program(tl.program_id(0), max_tiles, tl.cdiv(INTER, BN), GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e, rows, rmask = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr, tl.arange(0, BM))
    tok = (tl.load(sorted_pair_ptr + rows) // TOP_K).to(tl.int64)
    n1 = INTER * PLANES
    w_row0 = (e * n1 + pid_n * BNW).to(tl.int32)
    a_ptrs = x_ptr + tok[:, None] * H + tl.arange(0, BK)[None, :]
    kb_count = H // _SCALE_BLOCK
    ib_count = INTER // _SCALE_BLOCK
    wrow = tl.minimum(pid_n * BNW + tl.arange(0, BNW), n1 - 1)      # w13 row of each accumulator column
    if GATED:
        plane = (wrow // 8) % 2
        chan = (wrow // 16) * 8 + wrow % 8
    else:
        plane = wrow * 0
        chan = wrow
    # s13 [n, planes, I/128, H/128]: plane 0 gate (or up when not gated), plane 1 up
    sw_ptrs = ws_ptr + ((e * PLANES + plane) * ib_count + chan // _SCALE_BLOCK) * kb_count
    xs_ptrs = xs_ptr + tok * kb_count
    if W4:
        # the decoded weights are the dot's first operand (wgmma reads it from registers) and the
        # accumulator is transposed once after the loop
        acc_t = tl.zeros([BNW, BM], dtype=tl.float32)
        for k0 in range(0, H, BK):
            a = tl.load(a_ptrs)
            if W4 == 3:
                a = a.to(tl.bfloat16)   # E4M3 codes: exact in bf16
            acc_t = tl.dot(fp4_block(w_desc, ws_ptr, w_row0, e * n1 + wrow, k0, H, BK, PACKED, W4), a.T, acc_t)
            a_ptrs += BK
        acc = tl.trans(acc_t)
        if W4 == 2:
            # NVFP4's scale per expert and projection, g13 [n, planes]
            acc *= tl.load(g_ptr + e * PLANES + plane)[None, :]
        if W4 == 3:
            acc *= tl.load(xs_ptr + tok)[:, None]   # W4A8's activation scale per token, xs [tokens]
    else:
        acc = tl.zeros([BM, BNW], dtype=tl.float32)
        for k0 in range(0, H, BK):
            a = tl.load(a_ptrs)
            b = w_desc.load([w_row0, k0])
            if FP8:
                kblk = k0 // _SCALE_BLOCK
                acc += tl.dot(a, b.T) * (tl.load(xs_ptrs + kblk)[:, None] * tl.load(sw_ptrs + kblk)[None, :])
            else:
                acc = tl.dot(a, b.T, acc)
            a_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * n1 + wrow)[None, :]
    if GATED:
        g, u = _gate_up(acc, BM, BN)
    else:
        g = acc
        u = acc
    h = _activate(g, u, ACT, alpha, limit)
    # the intermediate is rounded to bf16 first, as the bf16 activation of every other path is
    hb = h.to(tl.bfloat16)
    cols = pid_n * BN + tl.arange(0, BN)
    out_rows = rows.to(tl.int64)
    smask = rmask[:, None] & (cols < INTER)[None, :]
    if FP8:
        # BN == 128 and INTER % 128 == 0: this block is one activation group of every row
        hf = hb.to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(hf), axis=1))
        tl.store(h_ptr + out_rows[:, None] * INTER + cols[None, :], _fp8_codes(hf, scale[:, None]), mask=smask)
        tl.store(hs_ptr + out_rows * ib_count + pid_n, scale, mask=rmask)
    else:
        tl.store(h_ptr + out_rows[:, None] * INTER + cols[None, :], hb, mask=smask)


@triton.jit
def gemm2(h_desc, hs_ptr, w_desc, ws_ptr, g_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, y_ptr,
          H, INTER, max_tiles, FP8: tl.constexpr, W4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, GROUP_M: tl.constexpr, PACKED: tl.constexpr):
    pid_m, pid_n = _program(tl.program_id(0), max_tiles, tl.cdiv(H, BN), GROUP_M)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    e, rows, rmask = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr, tl.arange(0, BM))
    # the tile's rows are consecutive: rows past its end belong to the next expert (or are past the
    # buffer, zero-filled); their results are never stored
    row0 = tl.load(tile_row_ptr + pid_m)
    w_row0 = (e * H + pid_n * BN).to(tl.int32)
    cols = pid_n * BN + tl.arange(0, BN)
    kb_count = INTER // _SCALE_BLOCK
    # s2 [n, H/128, I/128]
    sb_ptrs = ws_ptr + (e * (H // _SCALE_BLOCK) + tl.minimum(cols, H - 1) // _SCALE_BLOCK) * kb_count
    sa_ptrs = hs_ptr + rows.to(tl.int64) * kb_count
    if W4:
        # as in gemm1: the decoded weights as the dot's first operand, the accumulator transposed after
        wrows = e * H + tl.minimum(cols, H - 1)
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            a = h_desc.load([row0, k0])
            if W4 == 3:
                a = a.to(tl.bfloat16)   # E4M3 codes: exact in bf16
            acc_t = tl.dot(fp4_block(w_desc, ws_ptr, w_row0, wrows, k0, INTER, BK, PACKED, W4), a.T, acc_t)
        acc = tl.trans(acc_t)
        if W4 == 2:
            acc *= tl.load(g_ptr + e)   # NVFP4's scale per expert, g2 [n]
        if W4 == 3:
            acc *= tl.load(hs_ptr + rows)[:, None]   # the intermediate's scale per row, hs [pairs]
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            a = h_desc.load([row0, k0])
            b = w_desc.load([w_row0, k0])
            if FP8:
                kblk = k0 // _SCALE_BLOCK
                acc += tl.dot(a, b.T) * (tl.load(sa_ptrs + kblk)[:, None] * tl.load(sb_ptrs + kblk)[None, :])
            else:
                acc = tl.dot(a, b.T, acc)
    out = y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=rmask[:, None] & (cols < H)[None, :])


def _desc(t2d, block):
    return TensorDescriptor.from_tensor(t2d, list(block))


def _weight_desc(w, fmt, rows, bk):
    """TMA descriptor of a weight tensor [n, N, K] by blocks of `rows` x `bk` weights. FP4 formats: [n, N, K / 2]
    bytes in 16 x 64 tiles (layouts.tile_rows), read as 32-bit words [n N / 16, K / 64 * 16, 8] (row
    block, chunk * 16 + row, word) by blocks of one chunk (`bk` 64) of `rows` / 16 row blocks."""
    if fmt in W4_FORMATS:
        if bk != 64 or rows % 16:
            raise ValueError(f"FP4 blocks are 64 K elements of whole 16-row tiles, got {rows} x {bk}")
        return _desc(w.view(torch.int32).reshape(-1, w.shape[-1] // 2, 8), (rows // 16, 16, 8))
    return _desc(w.reshape(-1, w.shape[-1]), (rows, bk))


def _config(cfg) -> tuple:
    """(BM, BN, BK, warps, stages, GROUP_M, packed, overlap) of a GEMM configuration (BM, BN, BK, warps, stages[,
    GROUP_M[, packed[, overlap]]]): GROUP_M 0, the unpacked decode and no overlap where it stops short."""
    bm, bn, bk, warps, stages, group_m, packed, overlap = (*cfg, 0, False, False)[:8]
    return bm, bn, bk, warps, stages, group_m, bool(packed), bool(overlap)


def _overlap_cfg(fmt, bm, bn, bk, warps, stages, group_m, packed):
    """The Gluon configuration of an overlapped GEMM: gluon_w4's (BM, BN, STAGES, GROUP_M) for MXFP4 (64-element K
    steps on two warpgroups, the packed decode), gluon_fp8's (BM, BN, STAGES, GROUP_M) for FP8 (an MMA warpgroup
    each 64 token rows, a K step one scale block)."""
    if fmt == "w4a16_mxfp4" and bk == 64 and warps == 8 and packed:
        return bm, bn, stages, group_m
    if fmt == "fp8_block_scales" and bk == 128 and warps == 4 * (bm // 64) and not packed:
        return bm, bn, stages, group_m
    raise ValueError(f"the overlapped GEMMs are MXFP4 with BK 64, 8 warps and the packed decode, or FP8 with BK 128 "
                     f"and 4 warps each 64 token rows, got {fmt} {(bm, bn, bk, warps, stages, group_m, packed)}")


def launch_gemm1(x, xs, w, ws, g, bias, sorted_pair, offs, tile_expert, tile_row, num_tiles, h, hs, *, hidden,
                 inter, top_k, max_tiles, alpha, limit, fmt, gated, act, cfg):
    """GEMM1 over w13 [n, N1, H] (gate/up interleaved) of weight format `fmt` (bf16, fp8_block_scales, w4a16_mxfp4,
    w4a16_nvfp4 or w4a8_mxfp4_fp8; ws: its block scales; g: NVFP4's scales per expert and projection [n, planes]);
    x: bf16 tokens, or E4M3 codes with scales xs (FP8: [tokens, H / 128]; W4A8: [tokens]); cfg = (BM, BN of h, BK,
    warps, stages[, GROUP_M[, packed[, overlap]]]) (packed: the FP4 decode in bf16x2 pairs,
    `fp4_blocks.fp4_pair_packed`; overlap: the gluon_w4 kernel, whose decode of a K step overlaps the previous step's
    wgmma, or for FP8 gluon_fp8's warp-specialized kernel)."""
    bm, bn, bk, warps, stages, group_m, packed, overlap = _config(cfg)
    if overlap and fmt == "fp8_block_scales":
        from . import gluon_fp8

        bm, bn, stages, group_m = _overlap_cfg(fmt, bm, bn, bk, warps, stages, group_m, packed)
        if bn != 128:
            raise ValueError(f"FP8 gemm1 needs BN = 128 (one activation group), got {cfg}")
        return gluon_fp8.launch_gemm1(x, xs, w, ws, bias, sorted_pair, offs, tile_expert, tile_row, num_tiles, h, hs,
                                      hidden=hidden, inter=inter, top_k=top_k, max_tiles=max_tiles, alpha=alpha,
                                      limit=limit, gated=gated, act=act, cfg=(bm, stages, group_m))
    if overlap:
        from . import gluon_w4

        return gluon_w4.launch_gemm1(x, w, ws, bias, sorted_pair, offs, tile_expert, tile_row, num_tiles, h,
                                     hidden=hidden, inter=inter, top_k=top_k, max_tiles=max_tiles, alpha=alpha,
                                     limit=limit, gated=gated, act=act,
                                     cfg=_overlap_cfg(fmt, bm, bn, bk, warps, stages, group_m, packed))
    fp8 = fmt == "fp8_block_scales"
    if fp8 and (bn != 128 or bk != 128):
        raise ValueError(f"FP8 gemm1 needs BN = BK = 128 (one activation group, one weight block), got {cfg}")
    bnw = 2 * bn if gated else bn
    grid = (max_tiles * triton.cdiv(inter, bn),)
    dummy = offs   # unused pointer arguments of a variant (never read)
    gemm1[grid](x, dummy if xs is None else xs, _weight_desc(w, fmt, bnw, bk), dummy if ws is None else ws,
                dummy if g is None else g, dummy if bias is None else bias, sorted_pair, offs, tile_expert, tile_row,
                num_tiles, h, hs if fp8 else dummy, hidden, inter, top_k, max_tiles, alpha, limit,
                FP8=fp8, W4=W4_FORMATS.get(fmt, 0), GATED=gated, ACT=act, HAS_BIAS=bias is not None, BM=bm, BN=bn,
                BK=bk, GROUP_M=group_m, PACKED=packed, num_warps=warps, num_stages=stages)


def launch_gemm2(h, hs, w, ws, g, offs, tile_expert, tile_row, num_tiles, y, *, hidden, inter, max_tiles, fmt,
                 cfg):
    """GEMM2 over w2 [n, H, I] of weight format `fmt` into bf16 rows y [pairs, H] (ws: its block scales; g: NVFP4's
    scales per expert [n]); h: bf16 rows, or E4M3 codes with scales hs (FP8: [pairs, I / 128]; W4A8: [pairs]);
    cfg = (BM, BN, BK, warps, stages[, GROUP_M[, packed[, overlap]]]), as gemm1's."""
    bm, bn, bk, warps, stages, group_m, packed, overlap = _config(cfg)
    if overlap and fmt == "fp8_block_scales":
        from . import gluon_fp8

        return gluon_fp8.launch_gemm2(h, hs, w, ws, offs, tile_expert, tile_row, num_tiles, y, hidden=hidden,
                                      inter=inter, max_tiles=max_tiles,
                                      cfg=_overlap_cfg(fmt, bm, bn, bk, warps, stages, group_m, packed))
    if overlap:
        from . import gluon_w4

        return gluon_w4.launch_gemm2(h, w, ws, offs, tile_expert, tile_row, num_tiles, y, hidden=hidden, inter=inter,
                                     max_tiles=max_tiles,
                                     cfg=_overlap_cfg(fmt, bm, bn, bk, warps, stages, group_m, packed))
    fp8 = fmt == "fp8_block_scales"
    if fp8 and bk != 128:
        raise ValueError(f"FP8 gemm2 needs BK = 128 (one weight block), got {cfg}")
    grid = (max_tiles * triton.cdiv(hidden, bn),)
    gemm2[grid](_desc(h, (bm, bk)), offs if hs is None else hs, _weight_desc(w, fmt, bn, bk), offs if ws is None else ws,
                offs if g is None else g, offs, tile_expert, tile_row, num_tiles, y, hidden, inter, max_tiles, FP8=fp8,
                W4=W4_FORMATS.get(fmt, 0), BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PACKED=packed, num_warps=warps,
                num_stages=stages)

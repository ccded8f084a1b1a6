"""Gluon grouped GEMMs of the MXFP4 TRITON experts: the weight decode of one K step overlaps the previous step's wgmma.

The Triton kernels (triton_grouped.py) hand the decoded weights to wgmma from registers, so each K step
decodes, multiplies and waits for the product in turn (ncu at Q 8192: tensor pipe 36 % of cycles). Here
the decoded [weights x 64] block goes to shared memory in a double buffer and the wgmma runs
asynchronously: while step k multiplies, the same warps decode step k + 1. Token rows come by cp.async
(gathered for gemm1) into a ring of STAGES buffers; the packed words and scales of step k + 2 are loaded
into registers during step k. Same work list, operands, outputs and decode bits as triton_grouped's
MXFP4 path (`fp4_blocks.fp4_pair_packed`), so the same bf16 products; 8 warps, two warpgroups, each multiplying
its 64 weight rows by all BM token rows. Both warpgroups meet at barriers every step, so at BM 128 (229-240
registers: one CTA an SM) nothing fills those waits and the kernel is slower than the Triton one; at BM 64
(GEMM1 123-127 registers, GEMM2 121) two CTAs share an SM, which the plan uses (BENCHMARKS.md, seventeenth session).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.runtime.jit import constexpr_function

from .layouts import BF16_WORD_MAG, BF16_WORD_SIGN
from .triton_grouped import _activate, _program, _tile

_MAG, _SIGN = gl.constexpr(BF16_WORD_MAG), gl.constexpr(BF16_WORD_SIGN)
WARPS = gl.constexpr(8)   # two warpgroups; a K step is 64 elements, one 16 x 64 tile chunk (layouts.tile_rows)


@gluon.jit
def _pair(p, mul1, mul2):
    """fp4_blocks.fp4_pair_packed: the two bf16 weights of a packed pair, times 2^(s - 127) in two exact fma."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, z; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, $3, z; fma.rn.bf16x2 t, t, $4, z; "
        "mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r", [p, mul1, mul2], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def _fetch(w_ptr, ws_ptr, wrow, g, j, k, K):
    """The packed words [rows, 2, 4] of K step k (word 4g + j of each row's 16 x 64 tile chunk) and the E8M0
    scale [rows, 2, 1] of each half (one MX block of 32 elements: 4 words)."""
    tile = (wrow // 16).to(gl.int64) * (K // 64) + k
    words = gl.load(w_ptr + (tile * 128 + (wrow % 16) * 8)[:, None, None] + (g * 4)[None, :, None] + j[None, None, :])
    s = gl.load(ws_ptr + (tile * 32 + (wrow % 16) * 2)[:, None] + g[None, :])
    return words.to(gl.uint32, bitcast=True), gl.expand_dims(s.to(gl.uint32), 2)


@gluon.jit
def _decode(x, s, ROWS: gl.constexpr):
    """bf16 [ROWS, 64] of packed words x [ROWS, 2, 4] (layouts.BF16_WORD) and scales s [ROWS, 2, 1]."""
    mul1 = ((gl.minimum(s, 128) + 126) << 7) * 0x10001
    mul2 = ((gl.maximum(s, 128) - 1) << 7) * 0x10001
    e0, e1 = _pair(x & (_MAG | _SIGN), mul1, mul2)
    e2, e3 = _pair(((x >> 3) & _MAG) | ((x << 15) & _SIGN), mul1, mul2)
    e4, e5 = _pair(((x >> 6) & _MAG) | ((x << 14) & _SIGN), mul1, mul2)
    e6, e7 = _pair(((x << 3) & _MAG) | ((x << 13) & _SIGN), mul1, mul2)
    # element 8w + 4c + 2b + a of a row is e_(4c + 2b + a) of word w: joined innermost-last as (c, b, a)
    v = gl.join(gl.join(gl.join(e0, e4), gl.join(e2, e6)), gl.join(gl.join(e1, e5), gl.join(e3, e7)))
    return gl.reshape(v, [ROWS, 64])


@gluon.jit
def _gemm(x_ptr, xrow, w_ptr, ws_ptr, wrow, K, acc_layout: gl.constexpr, ROWS: gl.constexpr, BM: gl.constexpr,
          STAGES: gl.constexpr):
    """acc [ROWS, BM] = decoded weights of rows `wrow` (packed MXFP4) x token rows `xrow` of x [*, K] (bf16)."""
    word_layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [16, 2, 1], [WARPS, 1, 1], [2, 1, 0])
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, 64], gl.bfloat16)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, 64], smem_layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 64], x_layout)
    g = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, word_layout)))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, word_layout)))
    wr = gl.convert_layout(wrow, gl.SliceLayout(1, gl.SliceLayout(2, word_layout)))
    ks = gl.arange(0, 64, layout=gl.SliceLayout(0, row_layout))
    x_ptrs = x_ptr + gl.convert_layout(xrow, gl.SliceLayout(1, row_layout)).to(gl.int64)[:, None] * K + ks[None, :]
    steps = K // 64
    for s in gl.static_range(STAGES - 1):
        # a K of fewer steps copies its last one again (never multiplied): step s past the end would read past the row
        async_copy.async_copy_global_to_shared(x_smem.index(s), x_ptrs + gl.minimum(s, steps - 1) * 64)
        async_copy.commit_group()
    words, scales = _fetch(w_ptr, ws_ptr, wr, g, j, 0, K)
    a_smem.index(0).store(_decode(words, scales, ROWS))
    words, scales = _fetch(w_ptr, ws_ptr, wr, g, j, gl.minimum(1, steps - 1), K)
    acc = gl.zeros([ROWS, BM], gl.float32, acc_layout)
    for k in range(steps):
        # step k's token rows (this thread's copies) landed; then every thread's copies and decoded
        # weights are visible to the wgmma (the async proxy)
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(a_smem.index(k % 2), x_smem.index(k % STAGES).permute((1, 0)), acc, is_async=True)
        # step k - 1's product is done in both warpgroups: its weight buffer and token stage are free
        acc = warpgroup_mma_wait(1, deps=(acc,))
        gl.thread_barrier()
        nxt = gl.minimum(k + STAGES - 1, steps - 1)   # past the end: a harmless copy keeps the group count
        async_copy.async_copy_global_to_shared(x_smem.index((k + STAGES - 1) % STAGES), x_ptrs + nxt * 64)
        async_copy.commit_group()
        decoded = _decode(words, scales, ROWS)
        words, scales = _fetch(w_ptr, ws_ptr, wr, g, j, gl.minimum(k + 2, steps - 1), K)
        # past the last step this decodes the last block again into the free buffer: never multiplied
        a_smem.index((k + 1) % 2).store(decoded)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    async_copy.wait_group(0)
    return acc


@constexpr_function
def _acc_layout(bm):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, bm, 16])


@gluon.jit
def _store(out_ptr, vals, col0, width, rows, rmask):
    """vals [columns, rows] (fp32) as bf16 into out [*, width] at columns col0.. of `rows` (masked: `rmask`, columns
    past `width`), channel-fastest as the rows are laid out."""
    layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, WARPS], [0, 1])
    v = gl.convert_layout(vals.to(gl.bfloat16), layout)
    cols = col0 + gl.arange(0, v.shape[0], layout=gl.SliceLayout(1, layout))
    orows = gl.convert_layout(rows, gl.SliceLayout(0, layout)).to(gl.int64)
    omask = gl.convert_layout(rmask, gl.SliceLayout(0, layout))
    gl.store(out_ptr + orows[None, :] * width + cols[:, None], v, mask=omask[None, :] & (cols < width)[:, None])


@gluon.jit
def gemm1(x_ptr, w_ptr, ws_ptr, bias_ptr, sorted_pair_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
          h_ptr, H, INTER, TOP_K, max_tiles, alpha, limit, GATED: gl.constexpr, ACT: gl.constexpr,
          HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """h = act(gate, up) of the tile's gathered token rows (bf16), w13 rows interleaved by 8 (layouts)."""
    PLANES: gl.constexpr = 2 if GATED else 1
    BNW: gl.constexpr = BN * PLANES
    acc_layout: gl.constexpr = _acc_layout(BM)
    pid_m, pid_n = _program(gl.program_id(0), max_tiles, gl.cdiv(INTER, BN), GROUP_M)
    if pid_m < gl.load(num_tiles_ptr):
        lanes = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        e, rows, rmask = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr, lanes)
        tok = gl.load(sorted_pair_ptr + rows) // TOP_K
        n1 = INTER * PLANES
        wcol_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        wrow = e * n1 + gl.minimum(pid_n * BNW + gl.arange(0, BNW, layout=wcol_layout), n1 - 1)
        acc = _gemm(x_ptr, tok, w_ptr, ws_ptr, wrow, H, acc_layout, BNW, BM, STAGES)
        if HAS_BIAS:
            acc += gl.load(bias_ptr + wrow)[:, None]
        if GATED:
            # w13 rows 16b + i (gate) and 16b + 8 + i (up): channel 8b + i
            g, u = gl.split(gl.permute(gl.reshape(acc, [BN // 8, 2, 8, BM]), [0, 2, 3, 1]))
            g = gl.reshape(g, [BN, BM])
            u = gl.reshape(u, [BN, BM])
        else:
            g = acc
            u = acc
        h = _activate(g, u, ACT, alpha, limit)
        _store(h_ptr, h, pid_n * BN, INTER, rows, rmask)


@gluon.jit
def gemm2(h_ptr, w_ptr, ws_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, y_ptr, H, INTER, max_tiles,
          BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """y rows (bf16, sorted order) = the tile's h rows x decoded w2 rows."""
    acc_layout: gl.constexpr = _acc_layout(BM)
    pid_m, pid_n = _program(gl.program_id(0), max_tiles, gl.cdiv(H, BN), GROUP_M)
    if pid_m < gl.load(num_tiles_ptr):
        lanes = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        e, rows, rmask = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr, lanes)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        acc = _gemm(h_ptr, rows, w_ptr, ws_ptr, e * H + gl.minimum(cols, H - 1), INTER, acc_layout, BN, BM, STAGES)
        _store(y_ptr, acc, pid_n * BN, H, rows, rmask)


def launch_gemm1(x, w, ws, bias, sorted_pair, offs, tile_expert, tile_row, num_tiles, h, *, hidden, inter, top_k,
                 max_tiles, alpha, limit, gated, act, cfg):
    """gemm1 over packed MXFP4 w13 [n, N1, H / 2] (layouts.tile_rows) and its E8M0 scales; cfg = (BM, BN, STAGES,
    GROUP_M). A block is 128 w13 rows, one warpgroup's 64 each: BN 64 channels of a gated layer; an ungated
    layer's blocks are 128 channels whatever BN says."""
    bm, bn, stages, group_m = cfg
    if gated and bn != 64 or bm not in (64, 128):
        raise ValueError(f"gluon MXFP4 gemm1: 128 w13 rows a block (64 gated channels), 64 or 128 token rows, "
                         f"got BN {bn}, BM {bm}")
    bn = 64 if gated else 128
    grid = (max_tiles * triton.cdiv(inter, bn),)
    gemm1[grid](x, w.view(-1).view(torch.int32), ws, bias if bias is not None else offs, sorted_pair, offs,
                tile_expert, tile_row, num_tiles, h, hidden, inter, top_k, max_tiles, alpha, limit, GATED=gated,
                ACT=act, HAS_BIAS=bias is not None, BM=bm, BN=bn, GROUP_M=group_m, STAGES=stages, num_warps=WARPS)


def launch_gemm2(h, w, ws, offs, tile_expert, tile_row, num_tiles, y, *, hidden, inter, max_tiles, cfg):
    """gemm2 over packed MXFP4 w2 [n, H, I / 2] into bf16 rows y [pairs, H]; cfg = (BM, BN, STAGES, GROUP_M)."""
    bm, bn, stages, group_m = cfg
    if bn != 128 or bm not in (64, 128):
        raise ValueError(f"gluon MXFP4 gemm2: 128 w2 rows a block (two warpgroups of 64), got BN {bn}, BM {bm}")
    grid = (max_tiles * triton.cdiv(hidden, bn),)
    gemm2[grid](h, w.view(-1).view(torch.int32), ws, offs, tile_expert, tile_row, num_tiles, y, hidden, inter,
                max_tiles, BM=bm, BN=bn, GROUP_M=group_m, STAGES=stages, num_warps=WARPS)


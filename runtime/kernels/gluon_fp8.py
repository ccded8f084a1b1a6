"""Gluon grouped GEMMs of the FP8 TRITON experts: loads warp-specialized, one wgmma warpgroup per 64 token rows.

With 128x128 weight-block scales and 1x128 activation scales, each 128-element K block's product is scaled and added
to the fp32 accumulator on its own (DeepSeek's recipe). The Triton kernels (triton_grouped.py) run both warpgroups in
step and idle the tensor cores through each block's scale loads and promotion (BENCHMARKS.md). Here a load partition
fills a ring of STAGES slots (full/empty mbarriers) and each MMA warpgroup is a partition of its own, so one promotes
while the other's wgmma runs; each multiplies the weight block 64 columns at a time (32 product registers beside 128
of accumulators), so ptxas overlaps one part's promotion with the next part's wgmma; scales load a step ahead.
Weight blocks come by TMA; so do gemm2's token rows (h, already in sorted order), from one load warp. gemm1's are
gathered through the routing from the FP8 codes in token order by a load warpgroup's cp.async (TMA on sm_90 cannot
gather rows), so no pass writes them again in sorted order.

Work items are (token tile, weight block) pairs. gemm2 is persistent: a program per multiprocessor takes every
num_programs-th item, its load warp running on into the next item while the MMA warpgroups store this one. gemm1
keeps a program per item (see launch_gemm1). Tiles: 128 token rows (two MMA warpgroups) or 64 (one); gemm1's block
is 128 channels (gate and up interleaved by 8: 256 w13 rows), the 1x128 quantization group of its FP8 output;
gemm2's 128 or 256 output columns. A warpgroup whose 64 rows of a tile are all padding (an expert's last tile) lets
each K step's slot go without a product, so the other warpgroup has the tensor cores alone. Same products in the
same K order, promotion, activation and quantization as triton_grouped's FP8 path; the epilogues are in
gluon_fp8_epilogue.py.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from .gluon_fp8_epilogue import _act, _quant_store, _store
from .triton_grouped import _fp8_scale, _program, _tile

BK = gl.constexpr(128)   # a K step is one scale block
NW = gl.constexpr(64)    # columns of one product: four products cover 256 weight rows, two 128
WARPS = 4   # a warpgroup for each 64 token rows of a tile; one more warp loads (gemm2) or GATHER_WARPS (gemm1)
GATHER_WARPS = gl.constexpr(4)   # gemm1's loads: a thread for each 16 bytes of 8 of the tile's rows (at 128 rows)


@constexpr_function
def _acc_layout(n):
    """A product [64, n] of one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.jit
def _work(num_tiles_ptr, num_n):
    """(first item, stride, end, the call's token tiles): each program takes every num_programs-th item."""
    num_tiles = gl.load(num_tiles_ptr)
    return gl.program_id(0), gl.num_programs(0), num_tiles * num_n, num_tiles


@gluon.jit
def _item_rows(item, num_tiles, num_n, GROUP_M: gl.constexpr, ROW0: gl.constexpr, tile_expert_ptr, tile_row_ptr,
               offs_ptr, acc_layout: gl.constexpr):
    """(weight block, expert, rows, row mask) of work item `item` for the warpgroup of rows ROW0.. of its tile."""
    pid_m, pid_n = _program(item, num_tiles, num_n, GROUP_M)
    e, rows, rmask = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr,
                           ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout)))
    return pid_n, e, rows, rmask


@gluon.jit
def _loads(x_desc, w_desc, x_smem, w_smem, full, empty, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, num_n,
           expert_rows, steps, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """The load warp: the i-th K step of this program (over all its work items) into slot i % STAGES once the MMA
    warpgroups freed it, so the next item's first blocks load during this item's last products and epilogue."""
    first, stride, end, num_tiles = _work(num_tiles_ptr, num_n)
    i = 0
    for item in range(first, end, stride):
        pid_m, pid_n = _program(item, num_tiles, num_n, GROUP_M)
        x_row0 = gl.load(tile_row_ptr + pid_m)
        w_row0 = gl.load(tile_expert_ptr + pid_m) * expert_rows + pid_n * w_desc.block_type.shape[0]
        for k in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)   # the first round finds every slot free
            mbarrier.expect(full.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [x_row0, k * BK], full.index(slot), x_smem.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row0, k * BK], full.index(slot), w_smem.index(slot))
            i += 1


@constexpr_function
def _gather_layout():
    """A [rows, 128] block of FP8 codes: 16 bytes a copy, 8 threads along a row, the load warpgroup down the rows."""
    return gl.BlockedLayout([1, 16], [4, 8], [GATHER_WARPS.value, 1], [1, 0])


@gluon.jit
def _gather_loads(x_ptr, w_desc, x_smem, w_smem, full, empty, sorted_pair_ptr, offs_ptr, tile_expert_ptr,
                  tile_row_ptr, num_tiles_ptr, num_n, expert_rows, H, TOP_K, steps, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr):
    """gemm1's load warpgroup: K step i into slot i % STAGES once freed, the weight block by TMA, each token row by
    cp.async from x (FP8 codes in token order, int32 offsets); each thread arrives on `full` once its copies landed."""
    BM: gl.constexpr = x_smem.shape[1]
    layout: gl.constexpr = _gather_layout()
    first, stride, end, num_tiles = _work(num_tiles_ptr, num_n)
    i = 0
    for item in range(first, end, stride):
        pid_m, pid_n = _program(item, num_tiles, num_n, GROUP_M)
        e, rows, _ = _tile(pid_m, tile_expert_ptr, tile_row_ptr, offs_ptr,
                           gl.arange(0, BM, layout=gl.SliceLayout(1, layout)))
        # rows past the tile's end read its last row (_tile): the copies need no mask
        tok = gl.load(sorted_pair_ptr + rows) // TOP_K
        src = tok[:, None] * H + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))[None, :]
        w_row0 = (e * expert_rows + pid_n * w_desc.block_type.shape[0]).to(gl.int32)
        for k in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)   # the first round finds every slot free
            mbarrier.expect(full.index(slot), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [w_row0, k * BK], full.index(slot), w_smem.index(slot))
            async_copy.async_copy_global_to_shared(x_smem.index(slot), x_ptr + (src + k * BK))
            async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
            i += 1


@gluon.jit
def _scales(xs_ptrs, p00, p01, p10, p11, k, steps):
    """K step k's scales (clamped to the last): of each token row, of each half's two column planes' blocks."""
    kc = gl.minimum(k, steps - 1)
    return gl.load(xs_ptrs + kc), gl.load(p00 + kc), gl.load(p01 + kc), gl.load(p10 + kc), gl.load(p11 + kc)


@gluon.jit
def _part(a, w, q: gl.constexpr, t, acc, xs, s0, s1, plane):
    """acc + (the product of weight columns q * NW.. with the warpgroup's rows) x its scales."""
    t = warpgroup_mma(a, w.slice(q * NW, NW).permute((1, 0)), t, use_acc=False, is_async=True)
    t = warpgroup_mma_wait(0, deps=(t,))
    return t, acc + t * (xs[:, None] * gl.where(plane == 1, s1, s0)[None, :])


@gluon.jit
def _k_loop(x_smem, w_smem, full, empty, i0, ROW0: gl.constexpr, xs_ptrs, p00, p01, p10, p11, plane, steps,
            PARTS: gl.constexpr, STAGES: gl.constexpr, GATHERED: gl.constexpr):
    """One warpgroup's 64 token rows (from ROW0 of the tile) x the weight block, NW columns a part (PARTS: 2 or 4):
    per K step (this program's i0-th on) each part's product promoted into its accumulator, the first half of the
    parts with the scales (p00, p01) of its column plane (`plane`), the second half (p10, p11). GATHERED: cp.async
    wrote the token rows (generic proxy); the wgmma (async proxy) reads them after a proxy fence."""
    acc_layout: gl.constexpr = _acc_layout(NW)
    acc0 = gl.zeros([64, NW], gl.float32, acc_layout)
    acc1 = gl.zeros([64, NW], gl.float32, acc_layout)
    acc2 = gl.zeros([64, NW], gl.float32, acc_layout)
    acc3 = gl.zeros([64, NW], gl.float32, acc_layout)
    t = gl.zeros([64, NW], gl.float32, acc_layout)   # its value is never read (use_acc off): registers to reuse
    xs, s00, s01, s10, s11 = _scales(xs_ptrs, p00, p01, p10, p11, 0, steps)
    for k in range(steps):
        slot = (i0 + k) % STAGES
        nxt = _scales(xs_ptrs, p00, p01, p10, p11, k + 1, steps)
        mbarrier.wait(full.index(slot), ((i0 + k) // STAGES) & 1)
        if GATHERED:
            fence_async_shared()
        a = x_smem.index(slot).slice(ROW0, 64)
        w = w_smem.index(slot)
        if PARTS == 2:
            t, acc0 = _part(a, w, 0, t, acc0, xs, s00, s01, plane)
            t, acc1 = _part(a, w, 1, t, acc1, xs, s10, s11, plane)
        else:
            t, acc0 = _part(a, w, 0, t, acc0, xs, s00, s01, plane)
            t, acc1 = _part(a, w, 1, t, acc1, xs, s00, s01, plane)
            t, acc2 = _part(a, w, 2, t, acc2, xs, s10, s11, plane)
            t, acc3 = _part(a, w, 3, t, acc3, xs, s10, s11, plane)
        # the slot's last product is done: it may take another K step
        mbarrier.arrive(empty.index(slot))
        xs, s00, s01, s10, s11 = nxt
    return acc0, acc1, acc2, acc3


@gluon.jit
def _pass(full, empty, i0, steps, STAGES: gl.constexpr):
    """A warpgroup whose 64 rows of the tile are all padding (an expert's last tile, its rows in the first half):
    each K step's slot let go once it came, no product, so the other warpgroup has the tensor cores alone."""
    for k in range(steps):
        slot = (i0 + k) % STAGES
        mbarrier.wait(full.index(slot), ((i0 + k) // STAGES) & 1)
        mbarrier.arrive(empty.index(slot))


@gluon.jit
def _live(ROW0: gl.constexpr, item, num_tiles, num_n, GROUP_M: gl.constexpr, tile_expert_ptr, tile_row_ptr, offs_ptr):
    """Whether rows ROW0.. of the item's token tile hold a routed row (the first warpgroup's always do)."""
    if ROW0 == 0:
        return True
    pid_m, _ = _program(item, num_tiles, num_n, GROUP_M)
    e = gl.load(tile_expert_ptr + pid_m)
    return gl.load(tile_row_ptr + pid_m) + ROW0 < gl.load(offs_ptr + e + 1)


@gluon.jit
def _rings(BM: gl.constexpr, w_desc, STAGES: gl.constexpr, FULL_ARRIVALS: gl.constexpr):
    """The rings of [BM, 128] token and weight blocks, with barriers: a slot is full after FULL_ARRIVALS arrivals
    and its bytes, free once each MMA warpgroup (one each 64 token rows) let it go."""
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], x_layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=FULL_ARRIVALS)
        mbarrier.init(empty.index(s), count=BM // 64)
    fence_async_shared()
    return x_smem, w_smem, full, empty


@gluon.jit
def _gemm1_rows(ROW0: gl.constexpr, x_smem, w_smem, full, empty, xs_ptr, ws_ptr, bias_ptr, sorted_pair_ptr,
                offs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, alpha, limit,
                GATED: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr):
    """One warpgroup's part of gemm1 for each of this program's items: rows ROW0.. of the tile, the whole
    128-channel block, epilogue included."""
    N: gl.constexpr = w_smem.shape[1]   # w13 rows: 128 channels, times 2 when gated
    acc_layout: gl.constexpr = _acc_layout(NW)
    n1 = INTER * (2 if GATED else 1)
    kb_count = H // BK
    ib_count = INTER // BK
    col = gl.arange(0, NW, layout=gl.SliceLayout(0, acc_layout))
    plane = (col // 8) % 2 if GATED else col * 0
    first, stride, end, num_tiles = _work(num_tiles_ptr, ib_count)
    i0 = 0
    for item in range(first, end, stride):
        if _live(ROW0, item, num_tiles, ib_count, GROUP_M, tile_expert_ptr, tile_row_ptr, offs_ptr):
            pid_n, e, rows, rmask = _item_rows(item, num_tiles, ib_count, GROUP_M, ROW0, tile_expert_ptr, tile_row_ptr,
                                               offs_ptr, acc_layout)
            tok = (gl.load(sorted_pair_ptr + rows) // TOP_K).to(gl.int64)
            # s13 [n, planes, I/128, H/128]: the block's 128 channels are one scale block of each plane
            gate = ws_ptr + ((e * (2 if GATED else 1)) * ib_count + pid_n) * kb_count
            up = gate + ib_count * kb_count if GATED else gate
            acc0, acc1, acc2, acc3 = _k_loop(x_smem, w_smem, full, empty, i0, ROW0, xs_ptr + tok * kb_count, gate, up,
                                             gate, up, plane, kb_count, N // NW, STAGES, True)
            # the intermediate, then its quantization per row of the block's 128 channels
            b = bias_ptr + e * n1 + pid_n * N
            h0 = _act(acc0, b, HAS_BIAS, GATED, ACT, alpha, limit)
            h1 = _act(acc1, b + NW, HAS_BIAS, GATED, ACT, alpha, limit)
            amax = gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1))
            if N // NW == 4:
                h2 = _act(acc2, b + 2 * NW, HAS_BIAS, GATED, ACT, alpha, limit)
                h3 = _act(acc3, b + 3 * NW, HAS_BIAS, GATED, ACT, alpha, limit)
                amax = gl.maximum(amax, gl.maximum(gl.max(gl.abs(h2), axis=1), gl.max(gl.abs(h3), axis=1)))
            scale = _fp8_scale(amax)
            C: gl.constexpr = h0.shape[1]
            col0 = pid_n * 128
            _quant_store(h_ptr, h0, scale, rows, rmask, col0, INTER)
            _quant_store(h_ptr, h1, scale, rows, rmask, col0 + C, INTER)
            if N // NW == 4:
                _quant_store(h_ptr, h2, scale, rows, rmask, col0 + 2 * C, INTER)
                _quant_store(h_ptr, h3, scale, rows, rmask, col0 + 3 * C, INTER)
            gl.store(hs_ptr + rows.to(gl.int64) * ib_count + pid_n, gl.convert_layout(scale, rows.type.layout),
                     mask=rmask)
        else:
            _pass(full, empty, i0, kb_count, STAGES)
        i0 += kb_count


@gluon.jit
def gemm1(x_ptr, xs_ptr, w_desc, ws_ptr, bias_ptr, sorted_pair_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
          num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, alpha, limit, BM: gl.constexpr, GATED: gl.constexpr,
          ACT: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """h (FP8, 1x128 scales hs) = act(gate, up) of tiles of BM (64 or 128) sorted token rows, gathered from the FP8
    codes x and scales xs in token order, 128 channels a block."""
    # a slot is full once the weight block's bytes came (the TMA's arrival) and every load thread's copies landed
    x_smem, w_smem, full, empty = _rings(BM, w_desc, STAGES, 1 + 32 * GATHER_WARPS)
    loads = (x_ptr, w_desc, x_smem, w_smem, full, empty, sorted_pair_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
             num_tiles_ptr, INTER // 128, INTER * (2 if GATED else 1), H, TOP_K, H // BK, GROUP_M, STAGES)
    if BM == 128:
        gl.warp_specialize([
            (_gemm1_rows, (0, x_smem, w_smem, full, empty, xs_ptr, ws_ptr, bias_ptr, sorted_pair_ptr, offs_ptr,
                           tile_expert_ptr, tile_row_ptr, num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, alpha, limit,
                           GATED, ACT, HAS_BIAS, GROUP_M, STAGES)),
            (_gemm1_rows, (64, x_smem, w_smem, full, empty, xs_ptr, ws_ptr, bias_ptr, sorted_pair_ptr, offs_ptr,
                           tile_expert_ptr, tile_row_ptr, num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, alpha, limit,
                           GATED, ACT, HAS_BIAS, GROUP_M, STAGES)),
            (_gather_loads, loads),
        ], [4, GATHER_WARPS], [240, 24])
    else:
        gl.warp_specialize([
            (_gemm1_rows, (0, x_smem, w_smem, full, empty, xs_ptr, ws_ptr, bias_ptr, sorted_pair_ptr, offs_ptr,
                           tile_expert_ptr, tile_row_ptr, num_tiles_ptr, h_ptr, hs_ptr, H, INTER, TOP_K, alpha, limit,
                           GATED, ACT, HAS_BIAS, GROUP_M, STAGES)),
            (_gather_loads, loads),
        ], [GATHER_WARPS], [24])


@gluon.jit
def _gemm2_rows(ROW0: gl.constexpr, x_smem, w_smem, full, empty, hs_ptr, ws_ptr, offs_ptr, tile_expert_ptr,
                tile_row_ptr, num_tiles_ptr, y_ptr, H, INTER, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup's part of gemm2 for each of this program's items: rows ROW0.. of the tile, the whole block of
    output columns."""
    BN: gl.constexpr = w_smem.shape[1]
    acc_layout: gl.constexpr = _acc_layout(NW)
    kb_count = INTER // BK
    plane = gl.arange(0, NW, layout=gl.SliceLayout(0, acc_layout)) * 0
    num_n = gl.cdiv(H, BN)
    first, stride, end, num_tiles = _work(num_tiles_ptr, num_n)
    i0 = 0
    for item in range(first, end, stride):
        if _live(ROW0, item, num_tiles, num_n, GROUP_M, tile_expert_ptr, tile_row_ptr, offs_ptr):
            pid_n, e, rows, rmask = _item_rows(item, num_tiles, num_n, GROUP_M, ROW0, tile_expert_ptr, tile_row_ptr,
                                               offs_ptr, acc_layout)
            # s2 [n, H/128, I/128]: each 128 columns of the block are one scale block
            blk0 = ws_ptr + (e * (H // BK) + (pid_n * BN) // BK) * kb_count
            blk1 = ws_ptr + (e * (H // BK) + gl.minimum((pid_n * BN) // BK + 1, H // BK - 1)) * kb_count \
                if BN == 256 else blk0
            hs_rows = hs_ptr + rows.to(gl.int64) * kb_count
            acc0, acc1, acc2, acc3 = _k_loop(x_smem, w_smem, full, empty, i0, ROW0, hs_rows, blk0, blk0, blk1, blk1,
                                             plane, kb_count, BN // NW, STAGES, False)
            col0 = pid_n * BN
            _store(y_ptr, acc0.to(gl.bfloat16), rows, rmask, col0, H, 8)
            _store(y_ptr, acc1.to(gl.bfloat16), rows, rmask, col0 + NW, H, 8)
            if BN // NW == 4:
                _store(y_ptr, acc2.to(gl.bfloat16), rows, rmask, col0 + 2 * NW, H, 8)
                _store(y_ptr, acc3.to(gl.bfloat16), rows, rmask, col0 + 3 * NW, H, 8)
        else:
            _pass(full, empty, i0, kb_count, STAGES)
        i0 += kb_count


@gluon.jit
def gemm2(h_desc, hs_ptr, w_desc, ws_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr, num_tiles_ptr, y_ptr, H, INTER,
          GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """y rows (bf16, sorted order) = tiles of 64 or 128 FP8 h rows x w2 rows (BN = the weight block's rows, 128
    or 256)."""
    x_smem, w_smem, full, empty = _rings(h_desc.block_type.shape[0], w_desc, STAGES, 1)
    loads = (h_desc, w_desc, x_smem, w_smem, full, empty, tile_expert_ptr, tile_row_ptr, num_tiles_ptr,
             gl.cdiv(H, w_desc.block_type.shape[0]), H, INTER // BK, GROUP_M, STAGES)
    if h_desc.block_type.shape[0] == 128:
        gl.warp_specialize([
            (_gemm2_rows, (0, x_smem, w_smem, full, empty, hs_ptr, ws_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
                           num_tiles_ptr, y_ptr, H, INTER, GROUP_M, STAGES)),
            (_gemm2_rows, (64, x_smem, w_smem, full, empty, hs_ptr, ws_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
                           num_tiles_ptr, y_ptr, H, INTER, GROUP_M, STAGES)),
            (_loads, loads),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_gemm2_rows, (0, x_smem, w_smem, full, empty, hs_ptr, ws_ptr, offs_ptr, tile_expert_ptr, tile_row_ptr,
                           num_tiles_ptr, y_ptr, H, INTER, GROUP_M, STAGES)),
            (_loads, loads),
        ], [1], [24])


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(out, most_items: int) -> tuple[int]:
    """One program a multiprocessor (a program's rings fill its shared memory), never more than the call's largest
    count of work items (the count itself is known only on the device)."""
    return (max(1, min(_multiprocessors(out.device.index), most_items)),)


def _desc(t2d, rows):
    """TMA descriptor of FP8 rows t2d [R, K] by blocks of `rows` x 128."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
    return TensorDescriptor.from_tensor(t2d, [rows, 128], layout)


def launch_gemm1(x, xs, w, ws, bias, sorted_pair, offs, tile_expert, tile_row, num_tiles, h, hs, *, hidden, inter,
                 top_k, max_tiles, alpha, limit, gated, act, cfg):
    """gemm1 over FP8 w13 [n, N1, H] (gate/up interleaved by 8) and its block scales ws; x [tokens, H]: the FP8
    codes of the tokens, xs [tokens, H / 128] their scales, both in token order (the kernel gathers each routed
    pair's row); cfg = (BM, STAGES, GROUP_M): 64 or 128 token rows, blocks of 128 channels."""
    bm, stages, group_m = cfg
    if bm not in (64, 128):
        raise ValueError(f"gluon FP8 gemm1: 64 or 128 token rows (one MMA warpgroup each 64), got {bm}")
    if x.numel() >= 2**31:
        raise ValueError(f"gluon FP8 gemm1 gathers token rows at 32-bit offsets: {x.shape[0]} tokens of {hidden} "
                         f"codes are 2^31 bytes or more; call it on fewer tokens at a time")
    # a program for each work item, not one a multiprocessor: at the D shape (56 K steps, two tiles an expert
    # sharing each weight block) persistent programs drift apart and gemm1 took 6.26 ms against 4.53 (H100, ncu,
    # 2026-12-06); the hardware's in-order launch keeps the two tiles of a weight block running together
    gemm1[(max_tiles * triton.cdiv(inter, 128),)](
        x, xs, _desc(w.reshape(-1, hidden), 256 if gated else 128), ws, bias if bias is not None else offs,
        sorted_pair, offs, tile_expert, tile_row, num_tiles, h, hs, hidden, inter, top_k, alpha, limit, BM=bm,
        GATED=gated, ACT=act, HAS_BIAS=bias is not None, GROUP_M=group_m, STAGES=stages, num_warps=WARPS)


def launch_gemm2(h, hs, w, ws, offs, tile_expert, tile_row, num_tiles, y, *, hidden, inter, max_tiles, cfg):
    """gemm2 over FP8 w2 [n, H, I] into bf16 rows y [pairs, H]; cfg = (BM, BN, STAGES, GROUP_M): 64 or 128 token
    rows, 128 or 256 output columns."""
    bm, bn, stages, group_m = cfg
    if bm not in (64, 128) or bn not in (128, 256):
        raise ValueError(f"gluon FP8 gemm2: 64 or 128 token rows, 128 or 256 columns, got BM {bm}, BN {bn}")
    gemm2[_grid(y, max_tiles * triton.cdiv(hidden, bn))](
        _desc(h, bm), hs, _desc(w.reshape(-1, inter), bn), ws, offs, tile_expert, tile_row, num_tiles, y, hidden,
        inter, GROUP_M=group_m, STAGES=stages, num_warps=WARPS)

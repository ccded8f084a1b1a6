"""Triton FP8 block-scaled dense linear: `y = x W^T` with W as E4M3 codes and 128x128 block scales (DeepSeek's recipe).

Imported only when an FP8 linear runs on a GPU (Triton is absent on CPU-only hosts). Two launches
(three with split-K), no host synchronization, CUDA-graph capturable:
- `quant_act`: x [M, K] -> E4M3 codes and one fp32 scale per token per 128 channels (the experts'
  `quant_1x128`, so both quantize exactly as runtime/formats/fp8.quantize_act_groups does);
- `linear`: the experts' GEMM2 K-loop (`block_scaled_dot`: both scales applied per 128-wide K-block,
  fp32 accumulation) over one group of rows, tiles in `program_tiles` order; with split-K each
  program covers a K range and writes an fp32 partial;
- `splitk_sum`: the partials summed into the output dtype.

Configs (`plan`): prefill-sized M runs 128-row tiles (wgmma); decode-sized M (<= 64 rows) streams the
weight with 16/32/64-row tiles and splits K until the grid covers the SMs `DECODE_WAVES` times, since
N / BN tiles alone leave most of 132 SMs idle for the narrow projections (1536 or 576 outputs).
These are reasoned, not yet measured: `python3 bench/fp8_linear.py` times them against a sweep and
bf16 cuBLAS at deepseek_v3's shapes. On sm_90 Triton sums FP8 products at the tensor cores' reduced
precision within a dot (max_num_imprecise_acc); each dot here is one 128-deep block, promoted to fp32
after it, which is what bounds that error (measured 1.3e-4 relative on the 128-row tiles).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from runtime.kernels.triton_grouped import block_scaled_dot, program_tiles, quant_1x128, round_to_grid

BLOCK = 128
FP8 = torch.float8_e4m3fn
# (BM, BN, warps, stages, GROUP_M) of rows above DECODE_MAX_ROWS, and the decode tile width and stages.
PREFILL = (128, 128, 8, 4, 8)
DECODE_MAX_ROWS = 64
DECODE_BN, DECODE_WARPS, DECODE_STAGES = 64, 4, 4
DECODE_WAVES = 2
QUANT_ROWS = 8
# (mantissa bits, smallest normal exponent) of the output dtypes rounded explicitly (fp32: none).
_GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (0, 0)}


@triton.jit
def _out(acc, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    if MANT:
        acc = round_to_grid(acc, MANT, MIN_EXP)
    return acc


@triton.jit
def quant_act(x_ptr, q_ptr, s_ptr, M, K, KB, ROWS: tl.constexpr):
    """Rows [ROWS * pid0, +ROWS) x channels [128 * pid1, +128) of x into codes and their group scales."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    # channels past K read as 0: they neither raise the group's amax nor reach the GEMM (TMA zero-fills)
    q, scale = quant_1x128(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * KB + tl.program_id(1), scale, mask=rows < M)


@triton.jit
def linear(a_desc, sa_ptr, w_desc, sw_ptr, y_ptr, M, N, K, KB, K_SPLIT,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
           MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    pid_m, pid_n = program_tiles(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    # rows past M and columns past N read the last row's / column's scales (valid addresses); their
    # codes are TMA's zero fill, their results never stored
    sa_ptrs = sa_ptr + tl.minimum(rows, M - 1).to(tl.int64) * KB
    sb_ptrs = sw_ptr + (tl.minimum(cols, N - 1) // BK) * KB
    k_lo = split * K_SPLIT
    acc = block_scaled_dot(a_desc, pid_m * BM, sa_ptrs, w_desc, pid_n * BN, sb_ptrs, k_lo,
                           tl.minimum(K, k_lo + K_SPLIT), tl.zeros([BM, BN], dtype=tl.float32), True, BK)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT:
        tl.store(y_ptr + split.to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        tl.store(y_ptr + offs, _out(acc, MANT, MIN_EXP).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def splitk_sum(p_ptr, y_ptr, MN, SPLITS, BLOCK_E: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = offs < MN
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, _out(acc, MANT, MIN_EXP).to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, warps, stages, GROUP_M, K splits) for an [m, k] x [n, k]^T product on `sms` SMs."""
    if m > DECODE_MAX_ROWS:
        return (*PREFILL, 1)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, DECODE_BN)
    kb = triton.cdiv(k, BLOCK)
    split = max(1, min(kb, triton.cdiv(DECODE_WAVES * sms, tiles)))
    return bm, DECODE_BN, DECODE_WARPS, DECODE_STAGES, 0, triton.cdiv(kb, triton.cdiv(kb, split))


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, cfg=None) -> torch.Tensor:
    """x [M, K] (contiguous, any float dtype; K % 16 == 0 for the TMA strides), w [N, K] E4M3, ws
    [ceil(N/128), ceil(K/128)] fp32 -> y [M, N] in x's dtype. `cfg` overrides `plan` (benchmarks)."""
    m, k = x.shape
    n = w.shape[0]
    kb = triton.cdiv(k, BLOCK)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    xq = torch.empty((m, k), dtype=FP8, device=x.device)
    xs = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    quant_act[(triton.cdiv(m, QUANT_ROWS), kb)](x, xq, xs, m, k, kb, ROWS=QUANT_ROWS, num_warps=4)
    # on the CPU (Triton's interpreter, in tests) the plan is an H200's
    sms = _sms(x.device.index or 0) if x.is_cuda else 132
    bm, bn, warps, stages, group_m, split = cfg or plan(m, n, k, sms)
    blocks = triton.cdiv(kb, split)
    split = triton.cdiv(kb, blocks)   # no empty split
    a_desc = TensorDescriptor.from_tensor(xq, [bm, BLOCK])
    w_desc = TensorDescriptor.from_tensor(w, [bn, BLOCK])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    mant, min_exp = _GRID[x.dtype]
    linear[grid](a_desc, xs, w_desc, ws, out, m, n, k, kb, blocks * BLOCK, BM=bm, BN=bn, BK=BLOCK,
                 GROUP_M=group_m, SPLIT=split > 1, MANT=mant, MIN_EXP=min_exp, num_warps=warps, num_stages=stages)
    if split > 1:
        splitk_sum[(triton.cdiv(m * n, 1024),)](out, y, m * n, split, BLOCK_E=1024, MANT=mant, MIN_EXP=min_exp,
                                                num_warps=4)
    return y

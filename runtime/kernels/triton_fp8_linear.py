"""Triton W8A16 linear for decode-sized calls: `y = x W^T` with W as E4M3 codes and 128x128 block scales, x bf16/fp16.

Imported only when an FP8 linear runs on a GPU (Triton is absent on CPU-only hosts). Each weight tile is
decoded in registers to the activation dtype exactly as the loader's block dequantization rounds it
(runtime/formats/fp8.dequantize_weight_blocks: code x scale in fp32, rounded once), then multiplied on
the tensor cores with fp32 accumulation: the values and numerics of the dequantized layer, with one byte
per weight read instead of two. One launch (two with split-K: fp32 partials, then `splitk_sum`), no host
synchronization, CUDA-graph capturable. Rows <= DECODE_MAX_ROWS only (weight streaming: 16/32/64-row
tiles, K split until the grid covers the SMs `DECODE_WAVES` times, since N / BN tiles alone leave most of
132 SMs idle for the narrow projections); larger calls take the dequantized GEMM (runtime/ops/fp8_linear.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from runtime.kernels.triton_grouped import program_tiles, round_to_grid

BLOCK = 128
# The decode tile width, warps and stages.
DECODE_MAX_ROWS = 64
DECODE_BN, DECODE_WARPS, DECODE_STAGES = 64, 4, 4
DECODE_WAVES = 2
# (mantissa bits, smallest normal exponent) of the activation/output dtypes, rounded explicitly.
_GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


@triton.jit
def _out(acc, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    if MANT:
        acc = round_to_grid(acc, MANT, MIN_EXP)
    return acc


@triton.jit
def linear(a_desc, w_desc, sw_ptr, y_ptr, M, N, K, KB, K_SPLIT,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
           MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    pid_m, pid_n = program_tiles(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    # BN divides 128: the tile's weight rows share one row of block scales
    s_ptrs = sw_ptr + ((pid_n * BN) // BK) * KB
    k_lo = split * K_SPLIT
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BK):
        a = a_desc.load([pid_m * BM, k0])          # rows past M and columns past K: TMA's zero fill
        w = w_desc.load([pid_n * BN, k0])
        b = _out(w.to(tl.float32) * tl.load(s_ptrs + k0 // BK), MANT, MIN_EXP).to(a.dtype)
        acc = tl.dot(a, b.T, acc)
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
        raise ValueError(f"the W8A16 kernel streams weights for at most {DECODE_MAX_ROWS} rows, got {m}")
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, DECODE_BN)
    kb = triton.cdiv(k, BLOCK)
    split = max(1, min(kb, triton.cdiv(DECODE_WAVES * sms, tiles)))
    return bm, DECODE_BN, DECODE_WARPS, DECODE_STAGES, 0, triton.cdiv(kb, triton.cdiv(kb, split))


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, cfg=None) -> torch.Tensor:
    """x [M, K] (contiguous bf16/fp16, M <= DECODE_MAX_ROWS; K % 16 == 0 for the TMA strides), w [N, K] E4M3,
    ws [ceil(N/128), ceil(K/128)] fp32 -> y [M, N] in x's dtype. `cfg` overrides `plan` (benchmarks)."""
    m, k = x.shape
    n = w.shape[0]
    kb = triton.cdiv(k, BLOCK)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # on the CPU (Triton's interpreter, in tests) the plan is an H200's
    sms = _sms(x.device.index or 0) if x.is_cuda else 132
    bm, bn, warps, stages, group_m, split = cfg or plan(m, n, k, sms)
    if BLOCK % bn:
        raise ValueError(f"BN = {bn} must divide the {BLOCK}-row scale blocks")
    blocks = triton.cdiv(kb, split)
    split = triton.cdiv(kb, blocks)   # no empty split
    a_desc = TensorDescriptor.from_tensor(x, [bm, BLOCK])
    w_desc = TensorDescriptor.from_tensor(w, [bn, BLOCK])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    mant, min_exp = _GRID[x.dtype]
    linear[grid](a_desc, w_desc, ws, out, m, n, k, kb, blocks * BLOCK, BM=bm, BN=bn, BK=BLOCK,
                 GROUP_M=group_m, SPLIT=split > 1, MANT=mant, MIN_EXP=min_exp, num_warps=warps, num_stages=stages)
    if split > 1:
        splitk_sum[(triton.cdiv(m * n, 1024),)](out, y, m * n, split, BLOCK_E=1024, MANT=mant, MIN_EXP=min_exp,
                                                num_warps=4)
    return y

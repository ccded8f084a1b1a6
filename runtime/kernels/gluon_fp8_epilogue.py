"""The epilogues of the Gluon FP8 grouped GEMMs (gluon_fp8.py): gemm1's activation and E4M3 quantization of h, and
the masked row stores both GEMMs end with."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function

from .triton_grouped import _activate, _fp8_codes, _gate_up


@gluon.jit
def _act(acc, bias_ptr, HAS_BIAS: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr, alpha, limit):
    """The intermediate [64, C] of an accumulator part (C channels: 2C w13 rows interleaved by 8 when gated,
    layouts.interleave_gate_up), bias (its w13 rows at bias_ptr) added, rounded to bf16 as every path does."""
    if HAS_BIAS:
        col = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        acc += gl.load(bias_ptr + col)[None, :]
    if GATED:
        g, u = _gate_up(acc, 64, acc.shape[1] // 2)
    else:
        g = acc
        u = acc
    return _activate(g, u, ACT, alpha, limit).to(gl.bfloat16).to(gl.float32)


@constexpr_function
def _row_layout(columns, vec, warps):
    """Threads along a row of `columns` elements `vec` at a time, the rest of the warp and the warps down the rows."""
    across = min(columns // vec, 32)
    return gl.BlockedLayout([1, vec], [32 // across, across], [warps, 1], [1, 0])


@gluon.jit
def _store(out_ptr, vals, rows, rmask, col0, width, VEC: gl.constexpr):
    """vals [64, C] into out [*, width] at `rows` (masked: rmask, columns past width), columns col0.."""
    layout: gl.constexpr = _row_layout(vals.shape[1], VEC, gl.num_warps())
    v = gl.convert_layout(vals, layout)
    orows = gl.convert_layout(rows, gl.SliceLayout(1, layout)).to(gl.int64)
    omask = gl.convert_layout(rmask, gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, v.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + orows[:, None] * width + cols[None, :], v, mask=omask[:, None] & (cols < width)[None, :])


@gluon.jit
def _quant_store(h_ptr, hf, scale, rows, rmask, col0, INTER):
    """hf / scale per row as E4M3 codes into h (triton_grouped._fp8_codes, as its gemm1 quantizes)."""
    _store(h_ptr, _fp8_codes(hf, scale[:, None]), rows, rmask, col0, INTER, 16)

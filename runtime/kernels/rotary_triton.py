"""The Triton kernel of `runtime.kernels.rotary` and the pair rotation it shares with `runtime.kernels.rotary_cache`
(imported only where Triton is; module level, so kernels can call the helper by name)."""
import triton
import triton.language as tl


@triton.jit
def rotate_pairs(x, xp, cos_row, sin_row, pair, first, rotated, dtype: tl.constexpr):
    """`x[d] * c -/+ x[partner] * s` (fp32 values of dtype `dtype`) where `rotated`, else `x`: cos and sin
    rounded to `dtype` first, each product and the sum rounded to it, as torch's bf16 arithmetic does."""
    c = tl.load(cos_row + pair, mask=rotated, other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_row + pair, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    xc = (x * c).to(dtype).to(tl.float32)
    xs = (xp * s).to(dtype).to(tl.float32)
    return tl.where(rotated, tl.where(first, xc - xs, xc + xs), x)


@triton.jit
def rotate(x_ptr, cos_ptr, sin_ptr, y_ptr, seq, x_tok, x_head, dim,
           HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    d = tl.arange(0, BLOCK)
    inside = d < dim
    rotated = d < 2 * HALF
    if INTERLEAVED:
        pair = d // 2
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
    else:
        first = d < HALF
        pair = tl.where(first, d, d - HALF)
        partner = tl.where(first, d + HALF, d - HALF)
    src = x_ptr + tok * x_tok + head * x_head
    dtype = y_ptr.dtype.element_ty
    x = tl.load(src + d, mask=inside, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    row = (tok % seq) * HALF
    y = rotate_pairs(x, xp, cos_ptr + row, sin_ptr + row, pair, first, rotated, dtype)
    tl.store(y_ptr + (tok * heads + head) * dim + d, y.to(dtype), mask=inside)

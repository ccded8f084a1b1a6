"""The Triton kernel of `runtime.kernels.rotary_cache` (imported only where Triton is; module level, so the
kernel can call its helper by name)."""
import triton
import triton.language as tl

from runtime.kernels.rotary_triton import rotate_pairs


@triton.jit
def _norm_rope(src, w_ptr, cos_row, sin_row, d, inside, eps, dim, dtype: tl.constexpr,
               HALF: tl.constexpr, NORM: tl.constexpr, FP32_MUL: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    rotated = d < 2 * HALF
    first = d < HALF
    pair = tl.where(first, d, d - HALF)
    partner = tl.where(first, d + HALF, d - HALF)
    x = tl.load(src + d, mask=inside, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        if FP32_MUL:
            if ZERO_CENTERED:
                w = w + 1.0
                wp = wp + 1.0
            x = (x * r * w).to(dtype).to(tl.float32)
            xp = (xp * r * wp).to(dtype).to(tl.float32)
        else:
            x = (w * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            xp = (wp * (xp * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if HALF > 0:
        x = rotate_pairs(x, xp, cos_row, sin_row, pair, first, rotated, dtype)
    return x

@triton.jit
def qkv_rope_cache(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, kc_ptr, vc_ptr,
                   seq, row_stride, q_head_stride, k_off, v_off, q_heads, dim, eps,
                   kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
                   HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                   FP32_MUL: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    b = tok // seq
    s = tok % seq
    d = tl.arange(0, BLOCK)
    inside = d < dim
    dtype = q_ptr.dtype.element_ty
    row = qkv_ptr + tok * row_stride
    cos_row = cos_ptr + s * HALF
    sin_row = sin_ptr + s * HALF
    if head < q_heads:
        y = _norm_rope(row + head * q_head_stride, qw_ptr, cos_row, sin_row, d, inside, eps, dim, dtype,
                       HALF, NORM, FP32_MUL, ZERO_CENTERED)
        tl.store(q_ptr + (tok * q_heads + head) * dim + d, y.to(dtype), mask=inside)
    else:
        j = (head - q_heads).to(tl.int64)
        pos = tl.load(pos_ptr + s).to(tl.int64)
        y = _norm_rope(row + k_off + j * dim, kw_ptr, cos_row, sin_row, d, inside, eps, dim, dtype,
                       HALF, NORM, FP32_MUL, ZERO_CENTERED)
        # The key is rounded to the compute dtype first, then cast to the cache's, as the unfused path does.
        tl.store(kc_ptr + b * kc_b + j * kc_h + pos * kc_l + d,
                 y.to(dtype).to(kc_ptr.dtype.element_ty), mask=inside)
        v = tl.load(row + v_off + j * dim + d, mask=inside, other=0.0)
        tl.store(vc_ptr + b * vc_b + j * vc_h + pos * vc_l + d, v.to(vc_ptr.dtype.element_ty), mask=inside)

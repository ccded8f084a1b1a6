"""The Triton kernel of runtime/kernels/rms_norm.py (imported only where Triton is installed)."""
import triton
import triton.language as tl


@triton.jit
def rms_norm_rows(x_ptr, w_ptr, y_ptr, r_ptr, s_ptr, x_stride, y_stride, r_stride, n, eps,
                  BLOCK: tl.constexpr, FP32_MUL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                  RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=keep, other=0.0).to(tl.float32)
    if RESIDUAL:
        # The residual sum rounded to the input dtype (torch's bf16 add), written out, then normed.
        r = tl.load(r_ptr + row * r_stride + offs, mask=keep, other=0.0).to(tl.float32)
        x = (x + r).to(y_ptr.dtype.element_ty)
        tl.store(s_ptr + row * y_stride + offs, x, mask=keep)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    if FP32_MUL:
        if ZERO_CENTERED:
            w = w + 1.0
        y = normed * w
    else:
        y = w * normed.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * y_stride + offs, y.to(y_ptr.dtype.element_ty), mask=keep)

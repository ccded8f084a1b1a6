"""MXFP8 activations: E4M3 elements with one E8M0 scale per 32 along K, chosen dynamically (OCP floor rule)."""
import torch

from .fp8 import to_e4m3
from .mxfp4 import MX_BLOCK, e8m0_to_float, floor_scale_bits

E4M3_EMAX = 8   # 448 = 1.75 * 2^8


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the last dim to be a multiple of {MX_BLOCK}, got {tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def quantize_mxfp8(x: torch.Tensor):
    """(fp8 e4m3 [..., K], E8M0 bytes [..., K/32]).

    Elements are x / X rounded to nearest even and saturated at 448 (amax / X lies in [256, 512)).
    """
    blocks = _blocks(x)
    bits = floor_scale_bits(blocks.abs().amax(dim=-1), E4M3_EMAX)
    q = to_e4m3(blocks / e8m0_to_float(bits)[..., None])
    return q.reshape(x.shape), bits


def dequantize_mxfp8(q: torch.Tensor, scale_bits: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Values of MXFP8 [..., K] with E8M0 bytes [..., K/32], computed in fp32."""
    values = _blocks(q.float()) * e8m0_to_float(scale_bits)[..., None]
    return values.reshape(q.shape).to(dtype)


def qdq_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """What an MXFP8-activation GEMM sees of `x`, as fp32."""
    return dequantize_mxfp8(*quantize_mxfp8(x))

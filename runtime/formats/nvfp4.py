"""NVFP4 (NVIDIA ModelOpt): E2M1 elements, an E4M3 scale per 16 along K, and an fp32 global scale.

Formulas are ModelOpt's (research note, formats §1.4). Both scales are dequant multipliers:
value = e2m1 * float(block_scale) * global_scale, evaluated left to right in fp32 (the first product
is exact, so there is one rounding). For weights the global scale is `weight_scale_2`; for NVFP4
activations it is the checkpoint's static `input_scale`, and the block scales are computed per call.
"""
import torch

from .fp4 import E2M1_MAX, dequantize_e2m1, pack_fp4, quantize_e2m1
from .fp8 import FP8_E4M3_MAX, to_e4m3

NVFP4_BLOCK = 16
BLOCK_SCALE_MIN = 2.0 ** -9   # smallest E4M3 subnormal; ModelOpt clamps block scales to [2^-9, 448]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def _global(global_scale, like: torch.Tensor) -> torch.Tensor:
    """The global scale as fp32, shaped to broadcast against `like` from the left (scalar or leading dims)."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=like.device)
    return g.reshape(*g.shape, *([1] * (like.dim() - g.dim())))


def weight_scale_2(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor scale amax(w) / (6 * 448), fp32 scalar."""
    return w.float().abs().amax() / (E2M1_MAX * FP8_E4M3_MAX)


def quantize_nvfp4(x: torch.Tensor, global_scale):
    """(packed uint8 [..., K/2], E4M3 block scales [..., K/16]) of `x` under a given global scale.

    block_scale = e4m3(clamp(amax16 / (6 * global), 2^-9, 448)), 1.0 for an all-zero block;
    elements = e2m1_rne(x / (float(block_scale) * global)), saturating at 6 (an activation above its
    calibrated amax saturates).
    """
    blocks = _blocks(x)
    g = _global(global_scale, blocks[..., 0])
    per_block = blocks.abs().amax(dim=-1) / (E2M1_MAX * g)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    scale = to_e4m3(per_block.clamp(BLOCK_SCALE_MIN, FP8_E4M3_MAX))
    codes = quantize_e2m1(blocks / (scale.float() * g)[..., None])
    return pack_fp4(codes.reshape(x.shape)), scale


def quantize_nvfp4_weight(w: torch.Tensor, scale_2=None):
    """(weight uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 fp32 []).

    `scale_2` overrides the per-tensor scale, e.g. the one that gate and up of an expert share.
    """
    scale_2 = weight_scale_2(w) if scale_2 is None else torch.as_tensor(scale_2, dtype=torch.float32)
    packed, scale = quantize_nvfp4(w, scale_2)
    return packed, scale, scale_2


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values [..., K] of packed NVFP4 [..., K/2] with block scales [..., K/16].

    `global_scale` is a scalar or has the leading dims of a stacked weight ([E] for [E, out, in/2]).
    """
    k = packed.shape[-1] * 2
    if tuple(scale.shape) != (*packed.shape[:-1], k // NVFP4_BLOCK) or k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 block scales {tuple(scale.shape)} do not match packed weight "
                         f"{tuple(packed.shape)} (one scale per {NVFP4_BLOCK} elements)")
    values = dequantize_e2m1(packed).reshape(*packed.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    g = _global(global_scale, values)
    return ((values * scale.float()[..., None]) * g).reshape(*packed.shape[:-1], k).to(dtype)


def qdq_nvfp4_activation(x: torch.Tensor, input_scale) -> torch.Tensor:
    """What an NVFP4-activation GEMM sees of `x` with the static global scale `input_scale`, as fp32."""
    packed, scale = quantize_nvfp4(x, input_scale)
    return dequantize_nvfp4(packed, scale, input_scale)

"""MXFP4 (OCP MX v1.0): E2M1 elements with one E8M0 power-of-two scale per 32 along the input dim.

Also home of the E8M0 scale codec, which MXFP8 shares. Byte 0xFF is NaN (OCP §5.4.1); the gpt-oss and
transformers dequantizers instead read it as 2^128 (research note, pitfall 3), so they are oracles for
every scale but that one.
"""
import functools

import torch

from .fp4 import dequantize_e2m1, pack_fp4, quantize_e2m1

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# emax of the element format: the exponent of its largest normal (6 = 1.5 * 2^2, 448 = 1.75 * 2^8).
E2M1_EMAX = 2


def e8m0_table(device=None) -> torch.Tensor:
    """fp32 value of every E8M0 byte: 2^(bits - 127), NaN for 0xFF. Exact (2^-127 is an fp32 subnormal)."""
    values = [2.0 ** (bits - E8M0_BIAS) for bits in range(255)] + [float("nan")]
    return torch.tensor(values, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _device_e8m0_table(device: torch.device) -> torch.Tensor:
    # Built once per device: building it copies a host list to the device, a host sync a CUDA forward must not make.
    return e8m0_table(device)


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of E8M0 scale bytes (uint8)."""
    return _device_e8m0_table(bits.device)[bits.long()]


def floor_scale_bits(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """E8M0 bytes of X = 2^(floor(log2 amax) - emax_elem), the OCP §6.3 rule (torchao FLOOR).

    frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2 amax) = e - 1 with no rounding. A zero
    amax gets the smallest scale; exponents outside E8M0's range are clamped.
    """
    _, e = torch.frexp(amax.float())
    exponent = torch.where(amax > 0, e - 1 - emax_elem, torch.full_like(e, -E8M0_BIAS))
    return (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"MX formats need the last dim to be a multiple of {MX_BLOCK}, got {tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def quantize_mxfp4(w: torch.Tensor):
    """(packed uint8 [..., K/2], E8M0 bytes [..., K/32]) of `w` [..., K], OCP floor scale rule.

    Elements are w / X rounded to nearest even and saturated at 6; with the floor rule a block's
    largest elements can clip (amax / X lies in [4, 8)).
    """
    blocks = _blocks(w)
    bits = floor_scale_bits(blocks.abs().amax(dim=-1), E2M1_EMAX)
    codes = quantize_e2m1(blocks / e8m0_to_float(bits)[..., None])
    return pack_fp4(codes.reshape(w.shape)), bits


def dequantize_mxfp4(packed: torch.Tensor, scale_bits: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values [..., K] of packed MXFP4 [..., K/2] with E8M0 bytes [..., K/32], computed in fp32."""
    k = packed.shape[-1] * 2
    if tuple(scale_bits.shape) != (*packed.shape[:-1], k // MX_BLOCK) or k % MX_BLOCK:
        raise ValueError(f"MXFP4 scales {tuple(scale_bits.shape)} do not match packed weight "
                         f"{tuple(packed.shape)} (one scale per {MX_BLOCK} elements)")
    values = dequantize_e2m1(packed).reshape(*packed.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    return (values * e8m0_to_float(scale_bits)[..., None]).reshape(*packed.shape[:-1], k).to(dtype)


def gpt_oss_blocks_to_canonical(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss `*_blocks` [..., G, 16] (16 bytes = 32 elements per scale) -> canonical [..., G*16].

    The matching `*_scales` [..., G] are already the canonical scale layout.
    """
    if blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"gpt-oss blocks end in {MX_BLOCK // 2} bytes, got {tuple(blocks.shape)}")
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])


def canonical_to_gpt_oss_blocks(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed [..., K/2] -> gpt-oss `*_blocks` [..., K/32, 16]."""
    per_block = MX_BLOCK // 2
    if packed.shape[-1] % per_block:
        raise ValueError(f"packed MXFP4 rows must hold whole blocks of {per_block} bytes, "
                         f"got {tuple(packed.shape)}")
    return packed.reshape(*packed.shape[:-1], packed.shape[-1] // per_block, per_block)


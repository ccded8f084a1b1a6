"""FP4 E2M1 elements: the code -> value table, round-to-nearest-even quantization, two codes per byte.

E2M1 is the element of both MXFP4 and NVFP4. Packing puts element 2i in the low nibble and 2i+1 in the
high nibble, the convention of every producer checked (research note, formats §1.2).
"""
import functools

import torch

# Index = 4-bit code: sign bit 3, exponent bits 2:1 (bias 1), mantissa bit 0. No Inf, no NaN.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0

# Midpoints between consecutive magnitudes. A value exactly on a midpoint goes to the neighbour whose
# code is even (its mantissa bit is 0): down at 0.25, 1.25, 2.5 and 5, up at 0.75, 1.75 and 3.5.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)


def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 E2M1 values indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) of `x`: round to nearest even, saturating at +-6.

    NaN has no E2M1 code; it maps to a zero of its sign bit.
    """
    mag = x.float().abs()
    mids = torch.tensor(_MIDPOINTS + (float("inf"),), device=x.device)
    tie_up = torch.tensor(_TIE_GOES_UP + (False,), device=x.device)
    # bucketize (right=False) sends a value equal to a midpoint down; flip the ties that round up.
    code = torch.bucketize(mag, mids[:-1])
    code = code + ((mag == mids[code]) & tie_up[code]).long()
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | (codes[..., 0::2] & 0x0F)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The codes of `packed` (uint8 [..., n]) as uint8 [..., 2n]."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@functools.lru_cache(maxsize=None)
def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # byte -> (value of low nibble, value of high nibble): one gather decodes a whole byte. Built once per
    # device: building it copies a host list to the device, a host sync a CUDA forward must not make.
    values = e2m1_table(dtype, device)
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)


def dequantize_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of packed E2M1 bytes (uint8 [..., n]) as `dtype` [..., 2n]."""
    pairs = _pair_table(dtype, packed.device)[packed.long()]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)

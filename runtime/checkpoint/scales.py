"""Quantization scales whose values are NaN or infinite, refused as the loader reads them.

A NaN scale turns every weight of its block into NaN, which surfaces far away as NaN logits; no
header check can see it. The loader asks here about each scale it reads, so the check costs no extra
read: an FP8 block scale is 1/16384 of its weight, an FP4 one 1/16 to 1/8.
"""
from __future__ import annotations

import torch

# Canonical kinds that hold scales (input_scale: NVFP4's static activation scale).
SCALE_KINDS = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
# MXFP4 stores its E8M0 exponents as bytes; 255 is E8M0's NaN (OCP MX spec), it has no infinity.
E8M0_NAN = 255


def nonfinite(name: str, value: torch.Tensor, e8m0: bool = False) -> str | None:
    """Why scale tensor `name` (`value`: what was read of it; E8M0 bytes if `e8m0`) is unusable, or None."""
    if e8m0 and value.dtype == torch.uint8:
        count, what = int((value == E8M0_NAN).sum()), "E8M0 scale bytes are 255 (NaN)"
    elif value.is_floating_point():
        count, what = int((~torch.isfinite(value.float())).sum()), "scale values are NaN or infinite"
    else:
        return None
    if not count:
        return None
    return f"{name}: {count} of the {value.numel()} {what}; the checkpoint is corrupt: download or quantize it again"

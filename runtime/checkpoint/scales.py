"""Quantization scales whose values are NaN or infinite, found before a load copies anything.

A NaN scale turns every weight of its block into NaN, which surfaces far away as NaN logits; a header
check cannot see it, so the loader reads each scale this rank will use (scales are small next to the
weights they scale: 1/16384 of an FP8-block weight, 1/16 to 1/8 of a packed FP4 one) and asks here.
"""
from __future__ import annotations

import torch

# Canonical kinds that hold scales (input_scale: NVFP4's static activation scale).
SCALE_KINDS = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
# MXFP4 stores its E8M0 exponents as bytes; 255 is E8M0's NaN (OCP MX spec), it has no infinity.
E8M0_NAN = 255


def nonfinite(name: str, value: torch.Tensor, e8m0: bool = False) -> list[str]:
    """One message naming `name` when `value` (a scale tensor, E8M0 bytes if `e8m0`) holds NaN or
    infinity, else none."""
    if e8m0 and value.dtype == torch.uint8:
        bad, what = value == E8M0_NAN, "E8M0 scales are 255 (NaN)"
    elif value.is_floating_point():
        bad, what = ~torch.isfinite(value.float()), "scale values are NaN or infinite"
    else:
        return []
    count = int(bad.sum())
    if not count:
        return []
    first = tuple(torch.nonzero(bad)[0].tolist()) if bad.dim() else ()
    return [f"{name}: {count} of {bad.numel()} {what}, the first at index {first}; "
            f"the checkpoint is corrupt: download or quantize it again"]

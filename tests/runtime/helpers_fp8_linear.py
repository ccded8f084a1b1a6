"""The float64 oracle of an FP8 block-scaled linear, written out here (not runtime.formats): the dequantized layer in plain torch."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def weight_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each code times its 128x128 block's multiplier, in the codes' dtype once they are floats (fp32 or float64)."""
    rows, cols = codes.shape
    full = scale.to(codes.dtype).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return codes * full


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, fp32 block scales = block amax / 448) of a float weight, as DeepSeek's checkpoints hold it."""
    rows, cols = w.shape
    blocks = torch.nn.functional.pad(w.float(), (0, -cols % 128, 0, -rows % 128))
    blocks = blocks.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))         # [R/128, 128, C/128, 128]
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 `x @ W^T`, W the weight a dequantized build holds: each code times its block's multiplier in
    fp32, rounded to x's dtype."""
    w = weight_blocks(codes.float(), scale).float().to(x.dtype)
    return x.double() @ w.double().to(x.device).T


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).norm() / ref.norm())

"""The float64 oracle of an FP8 block-scaled linear, written out here (not runtime.formats): DeepSeek's recipe in plain torch."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def act_1x128(x: torch.Tensor) -> torch.Tensor:
    """float64 values a 1x128 FP8 GEMM multiplies: per token per 128 channels, scale = max(amax, 1e-4) / 448 in
    fp32, codes = x / scale rounded to E4M3 (torch's cast: nearest even) after saturating at 448."""
    x = x.float()
    k = x.shape[-1]
    pad = -k % 128
    g = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, 128))
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / E4M3_MAX
    codes = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.double() * scale.double()).flatten(-2)[..., :k]


def weight_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 weight: each code times its 128x128 block's multiplier."""
    rows, cols = codes.shape
    full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return codes.double() * full


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
    """float64 `act_1x128(x) @ weight_blocks(codes, scale)^T`."""
    return act_1x128(x) @ weight_blocks(codes, scale).to(x.device).T


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).norm() / ref.norm())

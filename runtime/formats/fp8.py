"""FP8 E4M3: DeepSeek-style 128x128 weight blocks, 1x128 dynamic activation groups, per-token scales.

Every scale here is a dequant multiplier (value = fp8 * scale), including the checkpoint tensor named
`weight_scale_inv` (research note, formats §1.5 and pitfall 6).
"""
import math

import torch

FP8_E4M3_MAX = 448.0
WEIGHT_BLOCK = 128
ACT_GROUP = 128
# DeepSeek act_quant floors each group's amax so an all-zero group gets a finite scale.
ACT_AMAX_FLOOR = 1e-4


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to E4M3 (nearest even), saturating at +-448.

    The explicit clamp matters: torch releases differ on whether an out-of-range cast saturates or
    gives NaN.
    """
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = -size % multiple
    if not extra:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = extra
    return torch.cat((x, x.new_zeros(pad_shape)), dim=dim)


def _to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., R, C] -> [..., R/b, b, C/b, b], zero-padding the edge blocks."""
    x = _pad_to(_pad_to(x, -2, block), -1, block)
    *lead, rows, cols = x.shape
    return x.reshape(*lead, rows // block, block, cols // block, block)


def quantize_weight_blocks(w: torch.Tensor, block: int = WEIGHT_BLOCK):
    """(fp8 [..., out, in], fp32 scale [..., ceil(out/b), ceil(in/b)]) with scale = block amax / 448.

    An all-zero block gets scale 1.0 (any positive scale encodes it exactly).
    """
    w = w.float()
    amax = _to_blocks(w.abs(), block).amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = to_e4m3(w / _expand_blocks(scale, block, w.shape[-2:]))
    return q, scale


def _expand_blocks(scale: torch.Tensor, block: int, shape) -> torch.Tensor:
    rows, cols = shape
    full = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :rows, :cols]


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                             block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """fp8 [..., out, in] times its block's fp32 multiplier, computed in fp32, returned as `dtype`."""
    *lead, rows, cols = q.shape
    expected = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(f"block scales {tuple(scale.shape)} do not match weight {tuple(q.shape)} "
                         f"with {block}x{block} blocks (expected [..., {expected[0]}, {expected[1]}])")
    blocks = _to_blocks(q.float(), block) * scale.float()[..., :, None, :, None]
    out = blocks.reshape(*lead, expected[0] * block, expected[1] * block)[..., :rows, :cols]
    return out.to(dtype)


def _group_view(x: torch.Tensor, group: int) -> torch.Tensor:
    x = _pad_to(x.float(), -1, group)
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def quantize_act_groups(x: torch.Tensor, group: int = ACT_GROUP):
    """(fp8 [..., K], fp32 scale [..., ceil(K/group)]): dynamic scale amax/448 per token per group.

    The last group of a K that is not a multiple of `group` is the remainder.
    """
    k = x.shape[-1]
    g = _group_view(x, group)
    scale = g.abs().amax(dim=-1).clamp_min(ACT_AMAX_FLOOR) / FP8_E4M3_MAX
    q = to_e4m3(g / scale[..., None]).reshape(*x.shape[:-1], -1)[..., :k]
    return q, scale


def dequantize_act_groups(q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """fp32 values of group-quantized activations."""
    k = q.shape[-1]
    g = _group_view(q.float(), group) * scale[..., None]
    return g.reshape(*q.shape[:-1], -1)[..., :k]


def qdq_act_groups(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """What a 1x128 FP8 GEMM sees of `x`, as fp32."""
    return dequantize_act_groups(*quantize_act_groups(x, group), group=group)


def quantize_act_per_token(x: torch.Tensor):
    """(fp8 [..., K], fp32 scale [..., 1]): dynamic scale amax/448 per token (amax floored as above)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_AMAX_FLOOR) / FP8_E4M3_MAX
    return to_e4m3(x / scale), scale


def qdq_act_per_token(x: torch.Tensor) -> torch.Tensor:
    """What a per-token FP8 GEMM sees of `x`, as fp32."""
    q, scale = quantize_act_per_token(x)
    return q.float() * scale

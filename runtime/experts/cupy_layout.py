"""The CUPY and TRITON experts' device buffers: their shapes per weight format, and the checkpoint's tensors
re-laid into them at load (gate/up rows interleaved per 8, FP4 bits rearranged, FP4 rows and their scales
tiled: runtime/kernels/layouts.py)."""
from __future__ import annotations

import torch

from ..kernels import SCALE_BYTES, WF
from ..kernels.layouts import interleave_gate_up, relayout_fp4, tile_rows
from .base import MoeShape


def buffer_specs(fmt: str, spec: MoeShape, n: int, i: int) -> dict:
    """name -> (shape, dtype) of the device buffers of `n` local experts of per-rank intermediate size `i`."""
    h = spec.hidden_size
    n1 = 2 * i if spec.gated else i
    if fmt == "bf16":
        specs = {"w13": ((n, n1, h), torch.bfloat16), "w2": ((n, h, i), torch.bfloat16)}
    elif fmt == "fp8_block_scales":
        planes = 2 if spec.gated else 1
        specs = {"w13": ((n, n1, h), torch.float8_e4m3fn), "w2": ((n, h, i), torch.float8_e4m3fn),
                 "s13": ((n, planes, i // 128, h // 128), torch.float32),
                 "s2": ((n, h // 128, i // 128), torch.float32)}
    elif fmt in ("w4a16_mxfp4", "w4a8_mxfp4_fp8"):
        specs = {"w13": ((n, n1, h // 2), torch.uint8), "w2": ((n, h, i // 2), torch.uint8),
                 "s13": ((n, n1, h // 32), torch.uint8), "s2": ((n, h, i // 32), torch.uint8)}
    else:   # w4a16_nvfp4
        specs = {"w13": ((n, n1, h // 2), torch.uint8), "w2": ((n, h, i // 2), torch.uint8),
                 "s13": ((n, n1, h // 16), torch.float8_e4m3fn), "s2": ((n, h, i // 16), torch.float8_e4m3fn),
                 "g13": ((n, 2 if spec.gated else 1), torch.float32), "g2": ((n,), torch.float32)}
    if spec.expert_bias:
        specs.update(b13=((n, n1), torch.float32), b2=((n, h), torch.float32))
    return specs


def convert(fmt: str, spec: MoeShape, expert_ids, staged, device) -> dict:
    """The buffers of `buffer_specs` from the staged checkpoint tensors `(expert, proj, kind) -> tensor` of
    `expert_ids` (in that order): gate/up rows interleaved, FP4 bits re-laid for the kernels' decode and
    their rows tiled by 16 x 64."""
    gated = spec.gated

    def stacked(proj, kind):
        return torch.stack([staged[e, proj, kind] for e in expert_ids])

    def first(kind, prepare=lambda t: t):
        if gated:
            return interleave_gate_up(prepare(stacked("gate", kind)), prepare(stacked("up", kind)))
        return prepare(stacked("up", kind))

    new = {}
    if fmt == "bf16":
        new["w13"], new["w2"] = first("weight"), stacked("down", "weight")
    elif fmt == "fp8_block_scales":
        as_bytes = lambda t: t.view(torch.uint8)   # noqa: E731  (stack/gather on raw bytes)
        new["w13"] = first("weight", as_bytes).view(torch.float8_e4m3fn)
        new["w2"] = stacked("down", "weight")
        if gated:
            new["s13"] = torch.stack((stacked("gate", "weight_scale_inv"), stacked("up", "weight_scale_inv")), 1)
        else:
            new["s13"] = stacked("up", "weight_scale_inv")[:, None]
        new["s2"] = stacked("down", "weight_scale_inv")
    else:
        layout = "e4m3" if fmt == "w4a8_mxfp4_fp8" else "bf16"
        relaid = lambda t: relayout_fp4(t, layout)   # noqa: E731
        new["w13"] = tile_rows(first("weight", relaid), 32)
        new["w2"] = tile_rows(relaid(stacked("down", "weight")), 32)
        per_chunk = SCALE_BYTES[WF[fmt]]
        scale_dtype = torch.float8_e4m3fn if fmt == "w4a16_nvfp4" else torch.uint8
        as_bytes = lambda t: t.view(torch.uint8)   # noqa: E731
        new["s13"] = tile_rows(first("weight_scale", as_bytes), per_chunk).view(scale_dtype)
        new["s2"] = tile_rows(as_bytes(stacked("down", "weight_scale")), per_chunk).view(scale_dtype)
        if fmt == "w4a16_nvfp4":
            projs = ("gate", "up") if gated else ("up",)
            new["g13"] = torch.stack([stacked(p, "weight_scale_2").reshape(-1) for p in projs], 1)
            new["g2"] = stacked("down", "weight_scale_2").reshape(-1)
    if spec.expert_bias:
        new["b13"] = first("bias").float()
        new["b2"] = stacked("down", "bias").float()
    return {name: value.contiguous().to(device) for name, value in new.items()}

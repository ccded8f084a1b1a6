"""How each run format stores an expert's weights: the canonical checkpoint tensors it reads, their shapes, this rank's slices of them, and their dequantization."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from ..formats.fp8 import WEIGHT_BLOCK, dequantize_weight_blocks
from ..formats.mxfp4 import MX_BLOCK, dequantize_mxfp4
from ..formats.nvfp4 import NVFP4_BLOCK, dequantize_nvfp4

# Run format -> its weight kind: which checkpoint tensors it reads. The three MXFP4 run formats read the same tensors.
WEIGHT_KIND = {
    "bf16": "bf16",
    "fp8_block_scales": "fp8",
    "w4a16_mxfp4": "mxfp4", "w4a8_mxfp4_fp8": "mxfp4", "w4a8_mxfp4_mxfp8": "mxfp4",
    "w4a16_nvfp4": "nvfp4", "nvfp4": "nvfp4",
}
# Weight kind -> its scale granularity along the input dim: hidden and intermediate sizes must be multiples of it.
DIM_UNIT = {"bf16": 1, "fp8": 1, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK}
# A MoE-TP shard of the intermediate dim must start on a scale boundary of both the gate/up rows
# (fp8 blocks span 128 rows) and the down columns.
SHARD_UNIT = {"bf16": 1, "fp8": WEIGHT_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK}
# Unquantized expert tensors (bf16 weights, biases) come in any of these: transformers saves
# fp32 by default, hub checkpoints are bf16. Between them the value is cast to what the module keeps.
PLAIN_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class CanonicalTensor:
    """One canonical tensor of every expert: its full checkpoint shape and this rank's slice of it."""
    proj: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: slice | None = None     # in stored units; None = all
    cols: slice | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        dims = list(self.shape)
        for axis, sl in ((0, self.rows), (1, self.cols)):
            if sl is not None:
                dims[axis] = len(range(*sl.indices(dims[axis])))
        return tuple(dims)


def _scaled(sl: slice, unit: int) -> slice:
    """An element slice of the intermediate dim in units of `unit` elements (scale blocks, packed bytes)."""
    return slice(sl.start // unit, math.ceil(sl.stop / unit))


def canonical_tensors(spec, fmt: str, inter: slice | None = None,
                      plain: torch.dtype = torch.bfloat16) -> tuple[CanonicalTensor, ...]:
    """The canonical tensors of one expert of the layer `spec` (a MoeShape) in run format `fmt`, sliced
    to the intermediate shard `inter` (None: the whole expert). gate/up shard their rows, down its
    columns; down's bias is whole. `plain` is the dtype unquantized weights and biases are kept in."""
    weight_kind = WEIGHT_KIND[fmt]
    h, i = spec.hidden_size, spec.intermediate_size
    out = []
    for proj in spec.projections:
        rows_out, cols_in = (i, h) if proj != "down" else (h, i)
        shard_rows = inter if proj != "down" else None
        shard_cols = inter if proj == "down" else None

        def add(kind, shape, dtype, unit_rows=1, unit_cols=1, scalar=False):
            rows = None if scalar or shard_rows is None else _scaled(shard_rows, unit_rows)
            cols = None if scalar or shard_cols is None else _scaled(shard_cols, unit_cols)
            out.append(CanonicalTensor(proj, kind, shape, dtype, rows, cols))

        if weight_kind == "bf16":
            add("weight", (rows_out, cols_in), plain)
        elif weight_kind == "fp8":
            add("weight", (rows_out, cols_in), torch.float8_e4m3fn)
            add("weight_scale_inv", (math.ceil(rows_out / WEIGHT_BLOCK), math.ceil(cols_in / WEIGHT_BLOCK)),
                torch.float32, WEIGHT_BLOCK, WEIGHT_BLOCK)
        elif weight_kind == "mxfp4":
            add("weight", (rows_out, cols_in // 2), torch.uint8, 1, 2)
            add("weight_scale", (rows_out, cols_in // MX_BLOCK), torch.uint8, 1, MX_BLOCK)
        else:
            add("weight", (rows_out, cols_in // 2), torch.uint8, 1, 2)
            add("weight_scale", (rows_out, cols_in // NVFP4_BLOCK), torch.float8_e4m3fn, 1, NVFP4_BLOCK)
            add("weight_scale_2", (), torch.float32, scalar=True)
            if fmt == "nvfp4":
                add("input_scale", (), torch.float32, scalar=True)
        if spec.expert_bias:
            rows = shard_rows if proj != "down" else None
            out.append(CanonicalTensor(proj, "bias", (rows_out,), plain, rows, None))
    return tuple(out)


# The canonical tensor kinds that make up a weight (a bias is not one of them).
WEIGHT_PARTS = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2")


def dequantize_canonical(fmt: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The [..., out, in] weight held by canonical `parts` (kind -> tensor, optionally stacked over
    experts), computed in fp32 and rounded once to `dtype`."""
    weight_kind = WEIGHT_KIND[fmt]
    if weight_kind == "bf16":
        return parts["weight"].to(dtype)
    if weight_kind == "fp8":
        return dequantize_weight_blocks(parts["weight"], parts["weight_scale_inv"], dtype)
    if weight_kind == "mxfp4":
        return dequantize_mxfp4(parts["weight"], parts["weight_scale"], dtype)
    return dequantize_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"], dtype)

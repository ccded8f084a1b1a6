"""Where an experts module's weights come from: the tensor-source protocol, an in-memory source, and seeded random weights in any run format."""
from __future__ import annotations

from typing import Mapping, Protocol

import torch

from .canonical import WEIGHT_KIND


class ExpertTensorSource(Protocol):
    """Canonical expert tensors of one MoE layer (docs/runtime.md gives the table of kinds)."""

    def name(self, expert: int, proj: str, kind: str) -> str: ...

    def shape(self, expert: int, proj: str, kind: str) -> tuple[int, ...] | None: ...

    def dtype(self, expert: int, proj: str, kind: str) -> torch.dtype: ...

    def get(self, expert: int, proj: str, kind: str, rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor: ...


class DictExpertSource:
    """An `ExpertTensorSource` over full canonical tensors held in memory, keyed (expert, proj, kind)."""

    def __init__(self, tensors: Mapping[tuple[int, str, str], torch.Tensor],
                 prefix: str = "model.layers.0.mlp.experts"):
        self.tensors = dict(tensors)
        self.prefix = prefix

    def name(self, expert, proj, kind):
        return f"{self.prefix}.{expert}.{proj}_proj.{kind}"

    def shape(self, expert, proj, kind):
        t = self.tensors.get((expert, proj, kind))
        return None if t is None else tuple(t.shape)

    def dtype(self, expert, proj, kind):
        return self.tensors[expert, proj, kind].dtype

    def get(self, expert, proj, kind, rows=None, cols=None):
        t = self.tensors[expert, proj, kind]
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t


def random_source(spec, fmt: str, experts, generator: torch.Generator, std: float = 0.02) -> DictExpertSource:
    """Random canonical tensors of `experts` (whole, unsharded) of the layer `spec` (a MoeShape) in run
    format `fmt`: bf16 weights drawn normal(0, std) and quantized with the format's own codecs, so codes
    and scales are valid."""
    from ..formats.fp8 import quantize_weight_blocks
    from ..formats.mxfp4 import quantize_mxfp4
    from ..formats.nvfp4 import quantize_nvfp4_weight

    weight_kind = WEIGHT_KIND[fmt]
    tensors = {}
    for expert in experts:
        for proj in spec.projections:
            out_dim, in_dim = (spec.intermediate_size, spec.hidden_size) if proj != "down" else (spec.hidden_size, spec.intermediate_size)
            w = torch.randn(out_dim, in_dim, generator=generator) * std
            if weight_kind == "bf16":
                parts = {"weight": w.to(torch.bfloat16)}
            elif weight_kind == "fp8":
                parts = dict(zip(("weight", "weight_scale_inv"), quantize_weight_blocks(w)))
            elif weight_kind == "mxfp4":
                parts = dict(zip(("weight", "weight_scale"), quantize_mxfp4(w)))
            else:
                parts = dict(zip(("weight", "weight_scale", "weight_scale_2"), quantize_nvfp4_weight(w)))
                if fmt == "nvfp4":
                    parts["input_scale"] = torch.tensor(1.0 / 448.0, dtype=torch.float32)
            if spec.expert_bias:
                parts["bias"] = (torch.randn(out_dim, generator=generator) * std).to(torch.bfloat16)
            tensors.update({(expert, proj, kind): value for kind, value in parts.items()})
    return DictExpertSource(tensors, prefix="random")

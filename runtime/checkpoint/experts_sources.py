"""`ExpertTensorSource` implementations: one MoE layer's expert tensors of a checkpoint, in the canonical `[out, in]` per-expert form.

Experts implementations ask for (expert, proj, kind) in the canonical form of docs/runtime.md and
never see a family's storage layout; these classes are the only place that knows how each family
stores them, and they read lazily (only the requested rows and columns) so a rank that owns a few
experts, or one intermediate shard, reads only those bytes.

Layouts (prefix = the layer's experts module, e.g. `model.layers.3.mlp.experts`):

- `gate_up_down`: `{prefix}.{e}.gate_proj|up_proj|down_proj.{kind}` - DeepSeek-V3, Kimi, Qwen3-MoE,
  GLM-4 MoE, Nemotron-H (up/down only), and ModelOpt NVFP4 exports of any family (ModelOpt splits
  fused experts per expert on export).
- `w1_w3_w2`: `{prefix}.{e}.w1|w3|w2.{kind}` with w1 = gate, w3 = up, w2 = down - Mixtral, MiniMax-M2
  (prefix `model.layers.{n}.block_sparse_moe.experts`).
- `gpt_oss_mxfp4`: the hub gpt-oss layout, one fused tensor per projection for all experts:
  `gate_up_proj_blocks` [E, 2I, H/32, 16] uint8, `gate_up_proj_scales` [E, 2I, H/32] uint8 (E8M0),
  `gate_up_proj_bias` [E, 2I], `down_proj_blocks` [E, H, I/32, 16], `down_proj_scales`, `down_proj_bias`
  [E, H]. Rows are outputs; gate and up are interleaved by row (row 2j = gate_j, row 2j+1 = up_j).
- `gpt_oss_bf16`: what transformers writes for an unquantized GptOss model (and what bf16 copies of
  gpt-oss on the hub hold): `gate_up_proj` [E, H, 2I] (input-major, i.e. transposed, and interleaved
  along its last dim), `down_proj` [E, I, H], biases as above.

What transformers 5.x `save_pretrained` writes (checked with transformers 5.24 by saving tiny models of
each family and listing the keys; tests/runtime/test_checkpoint_sources.py asserts it): transformers
5.x holds fused 3-D experts at run time (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
but reverts them on save, so the files carry the hub names:

| family | saved expert tensors (layer n) | router |
|---|---|---|
| deepseek_v3 | `model.layers.{n}.mlp.experts.{e}.{gate,up,down}_proj.weight` | `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` |
| glm4_moe | same as deepseek_v3 | same as deepseek_v3 |
| qwen3_moe | `model.layers.{n}.mlp.experts.{e}.{gate,up,down}_proj.weight` | `mlp.gate.weight` |
| mixtral | `model.layers.{n}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (module is `mlp` at run time) | `block_sparse_moe.gate.weight` |
| minimax_m2 | same as mixtral | `block_sparse_moe.gate.weight`, `block_sparse_moe.e_score_correction_bias` |
| gpt_oss | `model.layers.{n}.mlp.experts.gate_up_proj` [E, H, 2I], `down_proj` [E, I, H], `*_bias` (NOT reverted: the `gpt_oss_bf16` layout) | `mlp.router.weight`, `mlp.router.bias` |

So only gpt-oss differs from its hub checkpoint (which is MXFP4 `*_blocks`/`*_scales`); both are read here.
"""
from __future__ import annotations

from typing import Mapping

import torch

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.reader import CheckpointReader

PROJS = ("gate", "up", "down")
KINDS = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "bias")

GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
W1_W3_W2 = {"gate": "w1", "up": "w3", "down": "w2"}

LAYOUTS = ("gate_up_down", "w1_w3_w2", "gpt_oss_mxfp4", "gpt_oss_bf16")


def _check_key(proj: str, kind: str) -> None:
    # A wrong proj or kind is a bug in the caller, not a checkpoint problem: fail as such.
    if proj not in PROJS:
        raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _span(name: str, what: str, s: slice | None, n: int) -> tuple[int, int]:
    """(start, stop) of a canonical row or column slice, bounds-checked against size n."""
    if s is None:
        return 0, n
    if s.step not in (None, 1):
        raise CheckpointError(f"{name}: {what} slice {s} has a step; only contiguous slices are read")
    start = 0 if s.start is None else s.start
    stop = n if s.stop is None else s.stop
    if not 0 <= start <= stop <= n:
        raise CheckpointError(f"{name}: {what} {start}:{stop} out of range for size {n}")
    return start, stop


class PerExpertSource:
    """One tensor per expert per projection: `{prefix}.{e}.{proj_name}.{kind}`."""

    def __init__(self, reader: CheckpointReader, prefix: str, proj_names: Mapping[str, str] = GATE_UP_DOWN):
        self.reader = reader
        self.prefix = prefix
        self.proj_names = dict(proj_names)

    def name(self, expert: int, proj: str, kind: str) -> str:
        _check_key(proj, kind)
        return f"{self.prefix}.{expert}.{self.proj_names[proj]}.{kind}"

    def stored_name(self, expert: int, proj: str, kind: str) -> str:
        """The checkpoint tensor this canonical tensor is read from (here: the tensor itself)."""
        return self.name(expert, proj, kind)

    def shape(self, expert: int, proj: str, kind: str) -> tuple[int, ...] | None:
        name = self.name(expert, proj, kind)
        return self.reader.shape(name) if name in self.reader else None

    def dtype(self, expert: int, proj: str, kind: str) -> torch.dtype:
        return self.reader.dtype(self.name(expert, proj, kind))

    def get(self, expert: int, proj: str, kind: str, rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor:
        name = self.name(expert, proj, kind)
        shape = self.reader.shape(name)
        if (len(shape) < 2 and cols is not None) or (not shape and rows is not None):
            raise CheckpointError(f"{name}: cannot slice a tensor of shape {shape} by rows={rows} cols={cols}")
        if rows is None and cols is None:
            return self.reader.read(name)
        index = [slice(*_span(name, "rows", rows, shape[0]))]
        if cols is not None:
            index.append(slice(*_span(name, "cols", cols, shape[1])))
        return self.reader.read(name, tuple(index))

    def owned_names(self) -> list[str]:
        """Every checkpoint tensor under the prefix that this layout accounts for."""
        projs = set(self.proj_names.values())
        out = []
        for name in self.reader.names(self.prefix + "."):
            parts = name[len(self.prefix) + 1:].split(".")
            if len(parts) == 3 and parts[0].isdigit() and parts[1] in projs and parts[2] in KINDS:
                out.append(name)
        return out


# gpt-oss fused tensors: (proj, kind) -> (stored suffix, how it is stored). "blocks": [E, rows, G, 16]
# bytes, columns are the flattened (G, 16); "rows": [E, rows, ...] out-major; "t": [E, in, out]
# input-major (transposed). Gate and up share one tensor and are told apart by row parity.
_GPT_OSS_MXFP4 = {
    ("gate", "weight"): ("gate_up_proj_blocks", "blocks"),
    ("up", "weight"): ("gate_up_proj_blocks", "blocks"),
    ("down", "weight"): ("down_proj_blocks", "blocks"),
    ("gate", "weight_scale"): ("gate_up_proj_scales", "rows"),
    ("up", "weight_scale"): ("gate_up_proj_scales", "rows"),
    ("down", "weight_scale"): ("down_proj_scales", "rows"),
}
_GPT_OSS_BF16 = {
    ("gate", "weight"): ("gate_up_proj", "t"),
    ("up", "weight"): ("gate_up_proj", "t"),
    ("down", "weight"): ("down_proj", "t"),
}
_GPT_OSS_BIAS = {
    ("gate", "bias"): ("gate_up_proj_bias", "rows"),
    ("up", "bias"): ("gate_up_proj_bias", "rows"),
    ("down", "bias"): ("down_proj_bias", "rows"),
}
_BLOCK_BYTES = 16


class GptOssFusedSource:
    """gpt-oss fused experts (MXFP4 `*_blocks`/`*_scales` or bf16 `gate_up_proj`/`down_proj`), de-interleaved."""

    def __init__(self, reader: CheckpointReader, prefix: str, quantized: bool | None = None):
        self.reader = reader
        self.prefix = prefix
        if quantized is None:
            quantized = f"{prefix}.gate_up_proj_blocks" in reader
        self.quantized = quantized
        self._map = {**(_GPT_OSS_MXFP4 if quantized else _GPT_OSS_BF16), **_GPT_OSS_BIAS}

    def _stored(self, proj: str, kind: str) -> tuple[str, str] | None:
        _check_key(proj, kind)
        entry = self._map.get((proj, kind))
        return None if entry is None else (f"{self.prefix}.{entry[0]}", entry[1])

    def name(self, expert: int, proj: str, kind: str) -> str:
        # Names the stored tensor and the part of it this canonical tensor is, so a message about
        # expert 3's up weight points at the right rows of the fused tensor.
        stored = self._stored(proj, kind)
        if stored is None:
            suffix = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}[proj]
            return f"{self.prefix}.{suffix}_{kind}[{expert}]"
        where = {"gate": "0::2", "up": "1::2", "down": ":"}[proj]
        if stored[1] == "t":
            return f"{stored[0]}[{expert}, :, {where}]"
        return f"{stored[0]}[{expert}, {where}]"

    def stored_name(self, expert: int, proj: str, kind: str) -> str:
        stored = self._stored(proj, kind)
        return stored[0] if stored is not None else self.name(expert, proj, kind)

    def _lookup(self, expert: int, proj: str, kind: str):
        """(stored name, storage, stored shape, canonical shape), or None if not in the checkpoint."""
        stored = self._stored(proj, kind)
        if stored is None or stored[0] not in self.reader:
            return None
        name, storage = stored
        shape = self.reader.shape(name)
        want_dims = {"blocks": 4, "t": 3}.get(storage, 2 if kind == "bias" else 3)
        if len(shape) != want_dims:
            raise CheckpointError(f"{name}: expected a {want_dims}-d fused experts tensor, found shape {shape}")
        if not 0 <= expert < shape[0]:
            return None
        out_dim = shape[2] if storage == "t" else shape[1]
        if proj != "down":
            if out_dim % 2:
                raise CheckpointError(f"{name}: gate/up rows must be interleaved pairs, found {out_dim} rows")
            out_dim //= 2
        if storage == "blocks":
            canonical = (out_dim, shape[2] * shape[3])
        elif storage == "t":
            canonical = (out_dim, shape[1])
        else:
            canonical = (out_dim,) + tuple(shape[2:])
        return name, storage, shape, canonical

    def shape(self, expert: int, proj: str, kind: str) -> tuple[int, ...] | None:
        found = self._lookup(expert, proj, kind)
        return None if found is None else found[3]

    def dtype(self, expert: int, proj: str, kind: str) -> torch.dtype:
        stored = self._stored(proj, kind)
        if stored is None:
            raise CheckpointError(f"no tensor {self.name(expert, proj, kind)} in the checkpoint")
        return self.reader.dtype(stored[0])

    def get(self, expert: int, proj: str, kind: str, rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor:
        found = self._lookup(expert, proj, kind)
        if found is None:
            raise CheckpointError(f"no tensor {self.name(expert, proj, kind)} in the checkpoint")
        name, storage, shape, canonical = found
        label = self.name(expert, proj, kind)
        r0, r1 = _span(label, "rows", rows, canonical[0])
        if len(canonical) == 1 and cols is not None:
            raise CheckpointError(f"{label}: cannot slice a 1-d tensor by cols={cols}")
        c0, c1 = _span(label, "cols", cols, canonical[1]) if len(canonical) > 1 else (0, 0)
        stored_rows = self._stored_rows(proj, r0, r1)
        if storage == "t":
            part = self.reader.read(name, (expert, slice(c0, c1), stored_rows))
            return part.t().contiguous()
        if storage == "blocks":
            # Columns are bytes of the flattened (G, 16) groups: read whole groups, then trim.
            g0, g1 = c0 // _BLOCK_BYTES, -(-c1 // _BLOCK_BYTES)
            part = self.reader.read(name, (expert, stored_rows, slice(g0, g1)))
            part = part.reshape(part.shape[0], -1)[:, c0 - g0 * _BLOCK_BYTES:c1 - g0 * _BLOCK_BYTES]
            return part.contiguous()
        if len(canonical) == 1:
            return self.reader.read(name, (expert, stored_rows))
        return self.reader.read(name, (expert, stored_rows, slice(c0, c1)))

    @staticmethod
    def _stored_rows(proj: str, r0: int, r1: int) -> slice:
        if proj == "down":
            return slice(r0, r1)
        # Canonical row j of gate is stored row 2j, of up 2j+1: a stride-2 read of only those rows.
        offset = 0 if proj == "gate" else 1
        start = 2 * r0 + offset
        return slice(start, max(start, 2 * r1 - 1 + offset), 2)

    def owned_names(self) -> list[str]:
        suffixes = {entry[0] for entry in self._map.values()}
        return [n for n in self.reader.names(self.prefix + ".") if n[len(self.prefix) + 1:] in suffixes]


def detect_layout(reader: CheckpointReader, prefix: str) -> str:
    """Which of LAYOUTS the experts under `prefix` are stored in, from the tensor names alone."""
    if f"{prefix}.gate_up_proj_blocks" in reader:
        return "gpt_oss_mxfp4"
    if f"{prefix}.gate_up_proj" in reader:
        return "gpt_oss_bf16"
    projs = set()
    for name in reader.names(prefix + "."):
        parts = name[len(prefix) + 1:].split(".")
        if len(parts) == 3 and parts[0].isdigit():
            projs.add(parts[1])
    if projs & set(GATE_UP_DOWN.values()):
        return "gate_up_down"
    if projs & set(W1_W3_W2.values()):
        return "w1_w3_w2"
    raise CheckpointError(f"no expert tensors under {prefix} in the checkpoint at {reader.path} "
                          f"(looked for {prefix}.{{e}}.gate_proj|up_proj|down_proj.*, {prefix}.{{e}}.w1|w3|w2.*, "
                          f"{prefix}.gate_up_proj_blocks and {prefix}.gate_up_proj)")


def experts_source(reader: CheckpointReader, prefix: str, layout: str | None = None):
    """The source for the experts under `prefix`, in `layout` (one of LAYOUTS) or the detected one."""
    layout = layout or detect_layout(reader, prefix)
    if layout == "gate_up_down":
        return PerExpertSource(reader, prefix, GATE_UP_DOWN)
    if layout == "w1_w3_w2":
        return PerExpertSource(reader, prefix, W1_W3_W2)
    if layout == "gpt_oss_mxfp4":
        return GptOssFusedSource(reader, prefix, quantized=True)
    if layout == "gpt_oss_bf16":
        return GptOssFusedSource(reader, prefix, quantized=False)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

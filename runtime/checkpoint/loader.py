"""Loads a checkpoint into a build: every parameter and experts module is checked against the headers first, then filled one tensor at a time.

Validation covers the whole checkpoint before the first copy (missing, unexpected, wrong shape or
dtype, for plain parameters and for every expert tensor of every MoE layer), so a checkpoint that
does not fit leaves the build exactly as it was, and the error lists every problem at once; it reads the
headers only, and `check_checkpoint` runs it alone (on a build constructed on the meta device). Reading
then goes tensor by tensor (and shard by shard: a parameter with `shard = (dim, rank, size)` reads only
its chunk; with `shard = (dim, rank, size, segments)`, the checkpoint tensor is consecutive segments of
those lengths along `dim` (a fused projection) and the parameter is chunk `rank` of each, concatenated), so host memory peaks near the largest tensor, not the checkpoint. Scale values are
checked as they are read (runtime/checkpoint/scales.py): a NaN or infinite scale stops the load there,
naming the tensor, with the build partly filled (no byte is read twice, none held twice).

Names: a build's parameter and buffer names are checkpoint names (docs/runtime.md, "Model ops"); an
experts module's qualified name is the prefix of its layer's expert tensors. Tied parameters (one
tensor under several names) need only one of their names in the checkpoint.
"""
from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from runtime.checkpoint import quantized_weights, scales
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.experts_sources import experts_source
from runtime.checkpoint.reader import CheckpointReader, opened
from runtime.experts.base import WEIGHT_KIND, canonical_tensors

# Below this many bytes a load is over before a bar is worth drawing.
PROGRESS_MIN_BYTES = 1 << 30


@dataclass
class LoadReport:
    """What a successful load read."""

    tensors: int = 0
    bytes: int = 0
    experts_layers: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)     # checkpoint tensors skipped by the ignore list
    dequantized: list[str] = field(default_factory=list)  # parameters decoded from a quantized weight


@dataclass
class _Target:
    """One tensor of the build (possibly under several tied names) and how to fill it."""

    names: list[str]
    tensor: torch.Tensor
    ckpt_name: str = ""
    shard: tuple[int, int, int] | None = None     # (dim, start, stop) in the checkpoint tensor
    pieces: tuple[tuple[int, int], ...] = ()       # a shard's (start, stop) ranges along shard[0] (several: segmented)
    full_shape: tuple[int, ...] = ()
    quant: quantized_weights.QuantizedWeight | None = None
    nbytes: int = 0


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(shape) -> str:
    return str(tuple(shape))


def find_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Submodules that load their own weights from an ExpertTensorSource, by qualified name."""
    found = {}
    for name, mod in model.named_modules():
        inside = any(name.startswith(p + ".") for p in found)
        if name and not inside and callable(getattr(mod, "load_weights", None)):
            found[name] = mod
    return found


def load_checkpoint(model: nn.Module, checkpoint: str | Path | CheckpointReader, *,
                    experts: Mapping[str, object] | None = None,
                    ignore: Iterable[str] = (),
                    progress: bool | None = None,
                    device: torch.device | str = "cpu") -> LoadReport:
    """Fill `model` (plain parameters and buffers) and its experts modules from `checkpoint`.

    `experts` maps a checkpoint prefix to an experts module; when None, every submodule of `model`
    with a `load_weights` method is one, under its own qualified name. `ignore` holds fnmatch
    patterns of checkpoint tensors that no part of this build reads on purpose (e.g. MTP layers when
    the build has no draft). `progress`: True/False forces the bar on/off; None shows it on a
    terminal for loads of at least PROGRESS_MIN_BYTES. Raises CheckpointError, leaving `model` as
    it was, if the checkpoint does not fit (`check_checkpoint`'s refusals). `device`: where parameters of a
    build constructed on the meta device are materialised (others are filled in place, on their own device).
    """
    with opened(checkpoint) as reader:
        return _load(model, reader, _plan(model, reader, experts, ignore), progress, device)


def check_checkpoint(model: nn.Module, checkpoint: str | Path | CheckpointReader, *,
                     experts: Mapping[str, object] | None = None, ignore: Iterable[str] = ()) -> None:
    """CheckpointError, listing every problem, unless `load_checkpoint(model, checkpoint, experts=, ignore=)` would
    find the checkpoint fits: every tensor the build reads present with its shape and dtype (this rank's shards and
    experts), none left unread outside `ignore`. Reads the headers only, so `model` may be built on the meta device
    (a launcher checks a folder for each rank's build before any rank starts)."""
    with opened(checkpoint) as reader:
        _plan(model, reader, experts, ignore)


def _plan(model, reader, experts, ignore) -> tuple[list[_Target], dict, dict, list[str]]:
    """(the plain tensors, the experts modules by prefix, each one's source, the tensors ignored): what a load fills,
    from the headers only; CheckpointError listing every problem when the checkpoint does not fit."""
    experts = dict(find_experts_modules(model) if experts is None else experts)
    ignore = tuple(ignore)
    problems: list[str] = []
    claimed: set[str] = set()

    targets = _collect_targets(model, skip=experts)
    block = _fp8_block(reader)
    for t in targets:
        problems += _plan_target(reader, t, block)
        if t.ckpt_name:
            claimed.add(t.ckpt_name)
            # Tied names that are also in the checkpoint hold the same tensor: read once, claim all.
            claimed.update(n for n in t.names if n in reader)
        if t.quant is not None:
            claimed.update(t.quant.names)

    sources = {}
    for prefix in sorted(experts):
        try:
            source = experts_source(reader, prefix)
        except CheckpointError as e:
            problems += e.problems
            continue
        sources[prefix] = source
        found, names = _check_experts(source, experts[prefix])
        problems += found
        claimed.update(names)

    ignored = []
    for name in reader.names():
        if name in claimed:
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in ignore):
            ignored.append(name)
        else:
            problems.append(f"unexpected tensor {name}: no parameter of this build reads it")
    if problems:
        raise CheckpointError(problems)
    return targets, experts, sources, ignored


def _load(model, reader, plan, progress, device) -> LoadReport:
    """Fill `model` as `_plan` planned (the checkpoint fits): in file order, so consecutive reads stay within one shard."""
    targets, experts, sources, ignored = plan
    report = LoadReport(experts_layers=sorted(sources), ignored=ignored)
    total = sum(t.nbytes for t in targets) + sum(
        _experts_bytes(reader, sources[p], experts[p]) for p in sources)
    with _progress_bar(total, progress) as bar:
        for t in sorted(targets, key=lambda t: (reader.info(t.ckpt_name).file, t.ckpt_name)):
            _fill(model, reader, t, device)
            bar.update(t.nbytes)
            report.tensors += 1
            report.bytes += t.nbytes
            if t.quant is not None:
                report.dequantized.append(t.names[0])
        for prefix, source in sources.items():
            module = experts[prefix]
            if isinstance(module, nn.Module) and any(b.is_meta for b in module.buffers()):
                # Experts of a build constructed on the meta device get storage where the rest goes.
                module.to_empty(device=device)
            fmt = getattr(module, "FORMAT", None)
            counting = _CountingSource(source, bar, e8m0=WEIGHT_KIND.get(fmt) == "mxfp4")
            module.load_weights(counting)
            report.tensors += counting.tensors
            report.bytes += counting.bytes
    for module in model.modules():
        # Ops that keep a fused copy of separately named tensors (GQA's q/k/v) rebuild it from what was read.
        fuse = getattr(module, "fuse_projections", None)
        if callable(fuse):
            fuse()
    return report


# -- plain parameters and buffers ---------------------------------------------------------------------


def _collect_targets(model: nn.Module, skip: Mapping[str, object]) -> list[_Target]:
    """Parameters and persistent buffers outside the experts modules, grouped by tensor identity."""
    # An experts module is skipped by name and by identity: it may sit in the tree under a name
    # other than the prefix it was given for.
    skip_ids = {id(m) for m in skip.values()}
    skipped = [p + "." for p in skip]
    by_id: dict[int, _Target] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in skip_ids or mod_name in skip:
            skipped.append(mod_name + ".")
            continue
        if any(mod_name.startswith(p) for p in skipped):
            continue
        entries = list(mod._parameters.items()) + [
            (n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set]
        for local, tensor in entries:
            if tensor is None:
                continue
            full = f"{mod_name}.{local}" if mod_name else local
            target = by_id.setdefault(id(tensor), _Target(names=[], tensor=tensor))
            if full not in target.names:
                target.names.append(full)
    return list(by_id.values())


def _fp8_block(reader: CheckpointReader) -> int | list:
    """The FP8 weight block edge from quantization_config (128 when absent); the raw value when it
    is not a square block, which the codec cannot decode (reported per weight that needs it)."""
    qc = reader.quantization_config or {}
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if block is None:
        return quantized_weights.fp8.WEIGHT_BLOCK
    if isinstance(block, list) and len(block) == 2 and block[0] == block[1]:
        return int(block[0])
    return block


# Producers store routers and norms in bf16 or fp32 alike (transformers keeps DeepSeek's router fp32, the
# hub checkpoints hold it in bf16): between these the value is cast, like any HF loader does. Any other
# mismatch (fp8 or packed fp4 for a bf16 parameter, integers) is a different tensor and fails the load.
_PLAIN_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _plan_target(reader: CheckpointReader, t: _Target, block) -> list[str]:
    present = [n for n in t.names if n in reader]
    name = t.names[0]
    want = tuple(t.tensor.shape)
    shard = getattr(t.tensor, "shard", None)
    full = list(want)
    if shard is not None:
        # A plain shard is the one-segment case: chunk `rank` of the whole checkpoint dim.
        dim, rank, size = shard[:3]
        segments = shard[3] if len(shard) == 4 else (want[dim] * size,)
        full[dim] = sum(segments)
        offsets = [sum(segments[:i]) for i in range(len(segments))]
        pieces = tuple((o + rank * n // size, o + (rank + 1) * n // size) for o, n in zip(offsets, segments))
        t.shard, t.pieces = (dim, *pieces[0]), pieces
    t.full_shape = tuple(full)
    shard_note = f" (shard {shard[1]} of {shard[2]} along dim {shard[0]})" if shard is not None else ""
    if not present:
        also = f" (tied: {', '.join(t.names[1:])})" if len(t.names) > 1 else ""
        return [f"missing tensor {name}: the build expects shape {_shape(t.full_shape)} "
                f"{_dt(t.tensor.dtype)}{shard_note}{also}"]
    t.ckpt_name = present[0]
    info = reader.info(t.ckpt_name)
    t.nbytes = t.tensor.numel() * t.tensor.element_size()
    if info.dtype != t.tensor.dtype and not (info.dtype in _PLAIN_FLOATS and t.tensor.dtype in _PLAIN_FLOATS):
        edge = block if isinstance(block, int) else quantized_weights.fp8.WEIGHT_BLOCK
        quant, problems = quantized_weights.plan(reader, t.ckpt_name, t.full_shape, t.tensor.dtype, edge)
        if quant is None:
            return [f"{t.ckpt_name}: expected dtype {_dt(t.tensor.dtype)}, found {_dt(info.dtype or info.dtype_code)}"]
        t.quant = quant
        if len(t.pieces) > 1:
            return [f"{t.ckpt_name}: a quantized ({quant.scheme}) tensor is read whole or in one chunk per rank, not in the "
                    f"segments of a fused projection{shard_note}; build this layer with tp1"]
        if quant.scheme == "fp8_block" and not isinstance(block, int):
            return [f"{t.ckpt_name}: quantization_config weight_block_size {block} is not a square block; "
                    f"only square FP8 weight blocks are decoded"]
        if not problems and t.shard is not None:
            why = quantized_weights.shard_problem(quant, t.full_shape, *t.shard)
            problems = [why] if why else []
        return problems
    if info.shape != t.full_shape:
        return [f"{t.ckpt_name}: expected shape {_shape(t.full_shape)}{shard_note}, found {_shape(info.shape)}"]
    return []


def _fill(model: nn.Module, reader: CheckpointReader, t: _Target, device) -> None:
    if t.quant is not None:
        value = quantized_weights.read(reader, t.quant, t.full_shape, t.tensor.dtype, t.shard)
    elif t.pieces:
        dim = t.shard[0]
        parts = [reader.read(t.ckpt_name, (slice(None),) * dim + (slice(start, stop),)) for start, stop in t.pieces]
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    else:
        value = reader.read(t.ckpt_name)
    if not t.tensor.is_meta:
        with torch.no_grad():
            t.tensor.copy_(value)
        return
    # A build constructed on the meta device has no storage to copy into: put a real tensor in
    # place under every tied name, keeping what the op attached to the parameter (its shard).
    value = value.to(device=device, dtype=t.tensor.dtype)
    if isinstance(t.tensor, nn.Parameter):
        new = nn.Parameter(value, requires_grad=t.tensor.requires_grad)
        new.__dict__.update(t.tensor.__dict__)
    else:
        new = value
    for full in t.names:
        owner, _, local = full.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        (mod._parameters if local in mod._parameters else mod._buffers)[local] = new
    t.tensor = new


# -- experts ------------------------------------------------------------------------------------------


def _check_experts(source, module) -> tuple[list[str], set[str]]:
    """(problems, claimed checkpoint names) for one experts module, from the headers only.

    The module says what it will read (ExpertsBase.source_problems, this rank's experts); the layer
    claims the canonical tensors of all its experts, since other ranks read the rest.
    """
    spec = getattr(module, "spec", None)
    fmt = getattr(module, "FORMAT", None)
    if spec is None or fmt not in WEIGHT_KIND or not callable(getattr(module, "source_problems", None)):
        # A module that does not say what it reads: claim the layer's tensors and let its own
        # load_weights validate (its checks then run after the plain parameters are copied).
        return [], set(source.owned_names())
    problems = list(module.source_problems(source))
    kinds = {(t.proj, t.kind) for t in canonical_tensors(spec, fmt)}
    if WEIGHT_KIND[fmt] == "nvfp4":
        # An NVFP4 checkpoint carries input_scale whichever NVFP4 run format reads it (W4A16 does not).
        kinds |= {(proj, "input_scale") for proj in spec.projections}
    claimed = set()
    for e in range(spec.num_experts):
        for proj, kind in kinds:
            if source.shape(e, proj, kind) is not None:
                claimed.add(source.stored_name(e, proj, kind))
    return problems, claimed


def _experts_bytes(reader: CheckpointReader, source, module) -> int:
    """About what one experts module will read, for the progress bar's total: its layer's tensors
    divided among the ranks that share them (experts by EP, the intermediate dim by MoE TP)."""
    parallel = getattr(module, "parallel", None)
    ranks = getattr(parallel, "ep_size", 1) * getattr(parallel, "moe_tp_size", 1)
    return sum(reader.info(n).nbytes for n in source.owned_names()) // max(1, ranks)


class _CountingSource:
    """An ExpertTensorSource that passes every call through, advances the progress bar and refuses
    NaN or infinite scales (E8M0 bytes when `e8m0`)."""

    def __init__(self, source, bar, e8m0: bool = False):
        self._source, self._bar, self._e8m0 = source, bar, e8m0
        self.tensors = 0
        self.bytes = 0

    def name(self, expert, proj, kind):
        return self._source.name(expert, proj, kind)

    def shape(self, expert, proj, kind):
        return self._source.shape(expert, proj, kind)

    def dtype(self, expert, proj, kind):
        return self._source.dtype(expert, proj, kind)

    def get(self, expert, proj, kind, rows=None, cols=None):
        value = self._source.get(expert, proj, kind, rows=rows, cols=cols)
        if kind in scales.SCALE_KINDS:
            problem = scales.nonfinite(self._source.name(expert, proj, kind), value, self._e8m0)
            if problem:
                raise CheckpointError(problem)
        n = value.numel() * value.element_size()
        self.tensors += 1
        self.bytes += n
        self._bar.update(n)
        return value


# -- progress -----------------------------------------------------------------------------------------


class _NoBar:
    def update(self, n): pass

    def __enter__(self): return self

    def __exit__(self, *exc): pass


def _progress_bar(total: int, progress: bool | None):
    on_terminal = getattr(sys.stderr, "isatty", lambda: False)()
    show = progress if progress is not None else (on_terminal and total >= PROGRESS_MIN_BYTES)
    if not show:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading checkpoint",
                file=sys.stderr)

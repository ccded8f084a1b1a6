"""Non-expert linear weights that a checkpoint stores quantized, recognised by their companion scale tensors and dequantized at load.

Builds run attention, dense MLPs and shared experts in the parameter dtype (bf16) whatever the
checkpoint stores, so the loader turns `weight` + scales back into values here, with the exact codecs
of runtime/formats. The scheme is read off the tensors themselves (dtype + which scale tensors sit
beside the weight) rather than off the quant metadata: the tensors are what has to be decoded, and a
metadata file that disagrees with them would otherwise produce garbage silently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from runtime.checkpoint import scales
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.reader import CheckpointReader
from runtime.formats import fp8, mxfp4, nvfp4

FP8 = torch.float8_e4m3fn


@dataclass
class QuantizedWeight:
    """How to read one parameter from a quantized `weight` and its scales (all names claimed)."""

    scheme: str                       # "fp8_block" | "fp8_scaled" | "nvfp4" | "mxfp4"
    weight: str
    scales: dict[str, str]            # kind -> checkpoint name, e.g. {"weight_scale_inv": "...weight_scale_inv"}
    extra: list[str] = field(default_factory=list)   # claimed but not needed for values (input_scale)
    block: int = fp8.WEIGHT_BLOCK

    @property
    def names(self) -> list[str]:
        return [self.weight, *self.scales.values(), *self.extra]


def _base(name: str) -> str | None:
    return name[: -len(".weight")] if name.endswith(".weight") else None


def _fmt(shape) -> str:
    return str(tuple(shape))


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def plan(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype: torch.dtype,
         block: int = fp8.WEIGHT_BLOCK) -> tuple[QuantizedWeight | None, list[str]]:
    """(plan, problems) for reading parameter `name` of full `shape`/`dtype` from a quantized weight.

    (None, []) when the checkpoint tensor is not a quantized weight this module knows: the caller then
    reports the plain dtype mismatch.
    """
    base = _base(name)
    info = reader.info(name)
    if base is None or not dtype.is_floating_point or len(shape) != 2:
        return None, []
    have = {k: f"{base}.{k}" for k in ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
            if f"{base}.{k}" in reader}
    extra = [have["input_scale"]] if "input_scale" in have else []
    out_, in_ = shape
    problems: list[str] = []

    def expect(n: str, want_shape, want_dtypes) -> None:
        i = reader.info(n)
        if i.shape not in [tuple(s) for s in want_shape]:
            problems.append(f"{n}: expected shape {' or '.join(_fmt(s) for s in want_shape)}, found {_fmt(i.shape)}")
        if i.dtype not in want_dtypes:
            problems.append(f"{n}: expected dtype {' or '.join(_dt(d) for d in want_dtypes)}, found {i.dtype_code}")

    floats = (torch.float32, torch.bfloat16, torch.float16)
    if info.dtype == FP8 and "weight_scale_inv" in have:
        q = QuantizedWeight("fp8_block", name, {"weight_scale_inv": have["weight_scale_inv"]}, extra, block)
        expect(name, [shape], [FP8])
        # Scales are fp32 in DeepSeek's checkpoints; other FP8-block producers use bf16. Both decode the same.
        expect(have["weight_scale_inv"], [(math.ceil(out_ / block), math.ceil(in_ / block))], floats)
        return q, problems
    if info.dtype == FP8 and "weight_scale" in have:
        q = QuantizedWeight("fp8_scaled", name, {"weight_scale": have["weight_scale"]}, extra)
        expect(name, [shape], [FP8])
        # Per tensor (ModelOpt FP8) or per output channel.
        expect(have["weight_scale"], [(), (1,), (out_,), (out_, 1)], floats)
        return q, problems
    if info.dtype == torch.uint8 and "weight_scale" in have and "weight_scale_2" in have:
        q = QuantizedWeight("nvfp4", name, {"weight_scale": have["weight_scale"],
                                            "weight_scale_2": have["weight_scale_2"]}, extra)
        expect(name, [(out_, in_ // 2)], [torch.uint8])
        expect(have["weight_scale"], [(out_, in_ // nvfp4.NVFP4_BLOCK)], [FP8])
        expect(have["weight_scale_2"], [(), (1,)], [torch.float32])
        return q, problems
    if info.dtype == torch.uint8 and "weight_scale" in have:
        q = QuantizedWeight("mxfp4", name, {"weight_scale": have["weight_scale"]}, extra)
        expect(name, [(out_, in_ // 2)], [torch.uint8])
        expect(have["weight_scale"], [(out_, in_ // mxfp4.MX_BLOCK)], [torch.uint8])
        return q, problems
    return None, []


def shard_problem(q: QuantizedWeight, shape: tuple[int, ...], dim: int, start: int, stop: int) -> str | None:
    """Why a shard [start, stop) along `dim` cannot be read from this quantized weight, or None."""
    # NVFP4/MXFP4 scales cover 16/32 input elements: an input-dim shard must cut between scale groups.
    group = {"nvfp4": nvfp4.NVFP4_BLOCK, "mxfp4": mxfp4.MX_BLOCK}.get(q.scheme)
    if group and dim == 1 and (start % group or stop % group):
        return (f"{q.weight}: a shard of input columns {start}:{stop} does not fall on the "
                f"{group}-element scale groups of {q.scheme}")
    return None


def _scale(reader: CheckpointReader, q: QuantizedWeight, kind: str, index=None) -> torch.Tensor:
    """Scale tensor `kind` of `q` (or `index` of it), refused if it holds NaN or infinity."""
    value = reader.read(q.scales[kind], index)
    problem = scales.nonfinite(q.scales[kind], value, e8m0=q.scheme == "mxfp4")
    if problem:
        raise CheckpointError(problem)
    return value


def read(reader: CheckpointReader, q: QuantizedWeight, shape: tuple[int, ...], dtype: torch.dtype,
         shard: tuple[int, int, int] | None) -> torch.Tensor:
    """Values of the parameter (or of its shard [start, stop) along dim: `shard` = (dim, start, stop))."""
    if q.scheme in ("fp8_block", "fp8_scaled"):
        return _read_fp8(reader, q, shape, dtype, shard)
    dim, start, stop = shard if shard is not None else (0, 0, shape[0])
    # Rows are whole outputs; an input-dim shard is cut in packed bytes and in scale groups.
    rows, (col0, col1) = (slice(start, stop), (0, shape[1])) if dim == 0 else (slice(None), (start, stop))
    group = nvfp4.NVFP4_BLOCK if q.scheme == "nvfp4" else mxfp4.MX_BLOCK
    packed = reader.read(q.weight, (rows, slice(col0 // 2, col1 // 2)))
    scale = _scale(reader, q, "weight_scale", (rows, slice(col0 // group, col1 // group)))
    if q.scheme == "nvfp4":
        return nvfp4.dequantize_nvfp4(packed, scale, _scale(reader, q, "weight_scale_2").reshape(()), dtype)
    return mxfp4.dequantize_mxfp4(packed, scale, dtype)


def _read_fp8(reader, q, shape, dtype, shard) -> torch.Tensor:
    dim, start, stop = shard if shard is not None else (0, 0, shape[0])
    if q.scheme == "fp8_scaled":
        w = reader.read(q.weight, (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop)))
        s = _scale(reader, q, "weight_scale").float()
        if s.numel() > 1:
            s = s.reshape(-1, 1)[start:stop] if dim == 0 else s.reshape(-1, 1)
        return (w.float() * s).to(dtype)
    # Read the block-aligned stretch around the shard so the codec sees whole blocks, then trim.
    b = q.block
    lo, hi = start // b * b, min(-(-stop // b) * b, shape[dim])
    index = (slice(lo, hi),) if dim == 0 else (slice(None), slice(lo, hi))
    s_index = (slice(lo // b, -(-hi // b)),) if dim == 0 else (slice(None), slice(lo // b, -(-hi // b)))
    w = reader.read(q.weight, index)
    s = _scale(reader, q, "weight_scale_inv", s_index)
    values = fp8.dequantize_weight_blocks(w, s, dtype, block=b)
    return values.narrow(dim, start - lo, stop - start).contiguous()

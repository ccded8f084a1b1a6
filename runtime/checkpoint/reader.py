"""A lazy reader over one HF checkpoint folder: names, shapes and dtypes from the headers, tensors read one slice at a time.

A large MoE checkpoint is hundreds of gigabytes, so nothing here reads tensor data until asked, and a
read returns exactly the requested slice as a fresh, compact tensor: the caller's peak host memory is
the largest slice it asks for, not the checkpoint. Listing comes from the safetensors headers,
which the safetensors library parses and validates when the reader opens each file (a header that
lies about its length, offsets, shapes or dtypes is refused there, naming the file): opening a
checkpoint maps each shard but reads only its header. Quant metadata is returned as parsed JSON:
which layer runs which format is the registry's decision, not the reader's.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from runtime.checkpoint.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MODELOPT_QUANT_FILE = "hf_quant_config.json"

# safetensors dtype codes -> torch dtypes. Looked up by name so an older torch that lacks a dtype
# still opens checkpoints that do not use it.
_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
_DTYPES = {code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)}


@dataclass(frozen=True)
class TensorInfo:
    """What a header says about one tensor; `dtype` is None for a dtype this torch cannot hold."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    dtype_code: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (self.dtype.itemsize if self.dtype is not None else 1)


class CheckpointReader:
    """An open checkpoint folder. Use as a context manager, or call `close()`, to release the files."""

    def __init__(self, path: str | Path, *, max_open_files: int = 8):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        self._infos: dict[str, TensorInfo] = {}
        self._index_files: list[str] = []
        self._read_layout()
        self._sorted_names = sorted(self._infos)
        # safetensors handles are cheap to keep but each maps a whole shard; a bounded LRU keeps the
        # number of mappings small on checkpoints with a hundred shards.
        self._handles: OrderedDict[str, object] = OrderedDict()
        self._max_open = max(1, max_open_files)
        self._config: dict | None = None

    # -- layout ---------------------------------------------------------------------------------------

    def _read_layout(self) -> None:
        # Same preference as transformers: a single file wins over an index when both are present.
        single = self.path / SINGLE_FILE
        index = self.path / INDEX_FILE
        for path in (single, index):
            if (path.exists() or path.is_symlink()) and not path.is_file():
                raise CheckpointError(f"{path} is not a file (a folder or a broken link)")
        if single.is_file():
            self._index_files = [SINGLE_FILE]
            for info in self._read_header(SINGLE_FILE).values():
                self._infos[info.name] = info
            return
        if not index.is_file():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(n, str) and isinstance(f, str) for n, f in weight_map.items()):
            raise CheckpointError(f"{index} is not a safetensors index: its weight_map must be an object "
                                  f"of tensor names to shard file names")
        # A shard is a file of this folder: a name with a path in it would read outside the checkpoint.
        odd = sorted({f for f in weight_map.values() if f in ("", ".", "..") or Path(f).name != f or "\\" in f})
        if odd:
            raise CheckpointError(f"{index} names shard {odd[0]!r}, which is not a file name in {self.path}")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        missing = sorted(f for f in by_file if not (self.path / f).is_file())
        if missing:
            raise CheckpointError([
                f"missing shard file {f} referenced by {INDEX_FILE} "
                f"({len(by_file[f])} tensors, e.g. {sorted(by_file[f])[0]})" for f in missing])
        problems = []
        for file in sorted(by_file):
            header = self._read_header(file)
            for name in by_file[file]:
                if name not in header:
                    problems.append(f"{INDEX_FILE} puts {name} in {file}, but that file has no such tensor")
                else:
                    self._infos[name] = header[name]
        if problems:
            raise CheckpointError(problems)
        # Tensors a shard holds but the index does not list are not part of the checkpoint (as in
        # transformers): the index is the table of contents.
        self._index_files = sorted(by_file)

    def _read_header(self, file: str) -> dict[str, TensorInfo]:
        # safetensors validates the whole header when it opens the file (length, JSON, dtype codes,
        # offsets against shapes and the file size) and maps the file without reading tensor data.
        try:
            with safe_open(str(self.path / file), framework="pt") as handle:
                return {name: _info(name, file, handle.get_slice(name)) for name in handle.keys()}
        except (SafetensorError, OSError) as e:
            reason = str(e).removeprefix("Error while deserializing header: ")
            raise CheckpointError(f"{file} in {self.path} is not a readable safetensors file ({reason}); "
                                  f"download or write it again") from None

    # -- metadata -------------------------------------------------------------------------------------

    @property
    def config(self) -> dict:
        """config.json, parsed."""
        if self._config is None:
            path = self.path / CONFIG_FILE
            if not path.is_file():
                raise CheckpointError(f"no {CONFIG_FILE} in {self.path}")
            self._config = read_json(path)
        return self._config

    @property
    def quantization_config(self) -> dict | None:
        """config.json's `quantization_config` (DeepSeek FP8, gpt-oss MXFP4, ModelOpt's copy), or None."""
        if not (self.path / CONFIG_FILE).is_file():
            return None
        return self.config.get("quantization_config")

    @property
    def hf_quant_config(self) -> dict | None:
        """hf_quant_config.json (ModelOpt's own quant description), parsed, or None when absent."""
        path = self.path / MODELOPT_QUANT_FILE
        return read_json(path) if path.is_file() else None

    @property
    def files(self) -> list[str]:
        """The safetensors files that make up the checkpoint, relative to its folder."""
        return list(self._index_files)

    # -- listing --------------------------------------------------------------------------------------

    def names(self, prefix: str = "") -> list[str]:
        """Tensor names in sorted order, optionally only those starting with `prefix`."""
        if not prefix:
            return list(self._sorted_names)
        lo = bisect.bisect_left(self._sorted_names, prefix)
        out = []
        for name in self._sorted_names[lo:]:
            if not name.startswith(prefix):
                break
            out.append(name)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._sorted_names)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"no tensor {name} in the checkpoint at {self.path}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype | None:
        return self.info(name).dtype

    # -- reading --------------------------------------------------------------------------------------

    def read(self, name: str, index: tuple[int | slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or only `index` of it (ints and slices over the leading dims).

        The result owns compact, contiguous memory of exactly the selected elements: it never keeps
        the rest of the tensor alive, nor a mapping of the file (which could change under it).
        """
        info = self.info(name)
        if info.dtype is None:
            raise CheckpointError(f"{name}: dtype {info.dtype_code} is not supported by torch {torch.__version__}")
        handle = self._handle(info.file)
        if index is None or not info.shape:
            view = handle.get_tensor(name)
        else:
            # safetensors is asked only for contiguous ranges (strided slicing is not in every
            # release pyproject admits); steps are applied here, before the copy below.
            index = _checked_index(name, info.shape, index)
            view = handle.get_slice(name)[tuple(
                slice(i.start, i.stop) if isinstance(i, slice) else i for i in index)]
            steps = tuple(slice(None, None, i.step) for i in index if isinstance(i, slice))
            if any(s.step != 1 for s in steps):
                view = view[steps]
        # safetensors may hand back a view into a mapping of the whole file; copy out just the slice.
        return view.clone(memory_format=torch.contiguous_format)

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self.path / file), framework="pt")
            self._handles[file] = handle
            while len(self._handles) > self._max_open:
                _, old = self._handles.popitem(last=False)
                _close(old)
        else:
            self._handles.move_to_end(file)
        return handle

    def close(self) -> None:
        while self._handles:
            _, handle = self._handles.popitem()
            _close(handle)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def opened(checkpoint: str | Path | CheckpointReader):
    """A context giving a reader of `checkpoint`: an open reader as it is (its owner closes it), a folder opened
    for the block and closed after it."""
    return contextlib.nullcontext(checkpoint) if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)


def _info(name: str, file: str, view) -> TensorInfo:
    code = view.get_dtype()
    return TensorInfo(name, file, tuple(view.get_shape()), _DTYPES.get(code), code)


def read_json(path: Path) -> dict:
    """A JSON object from `path`; anything else (unreadable, not UTF-8, not JSON, too deep, not an
    object) is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _close(handle) -> None:
    # safe_open objects close through their context-manager exit (no close() on older safetensors).
    exit_ = getattr(handle, "__exit__", None)
    if exit_ is not None:
        exit_(None, None, None)


def _checked_index(name: str, shape: tuple[int, ...], index: tuple[int | slice, ...]) -> tuple:
    """`index` with every bound checked: safetensors clamps an out-of-range slice silently, which
    would turn a caller's off-by-one into a wrongly shaped tensor far from its cause."""
    if len(index) > len(shape):
        raise CheckpointError(f"{name}: index {index} has more entries than the tensor has dims {shape}")
    out = []
    for dim, (i, n) in enumerate(zip(index, shape[:len(index)], strict=True)):
        if isinstance(i, slice):
            start, stop, step = i.start or 0, n if i.stop is None else i.stop, i.step or 1
            if step < 1 or not (0 <= start <= stop <= n):
                raise CheckpointError(f"{name}: slice {start}:{stop}:{step} out of range for dim {dim} of size {n}")
            out.append(slice(start, stop, step))
        else:
            if not 0 <= int(i) < n:
                raise CheckpointError(f"{name}: index {i} out of range for dim {dim} of size {n}")
            out.append(int(i))
    return tuple(out)

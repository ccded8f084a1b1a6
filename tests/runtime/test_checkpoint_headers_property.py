"""Property: whatever a safetensors file's header says, opening, reading and loading it either works as the header says or raises CheckpointError; nothing else escapes (issue 10, "Done when")."""
from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.loader import load_checkpoint
from runtime.checkpoint.reader import CheckpointReader

CODES = ["F32", "BF16", "F16", "U8", "I64", "F8_E4M3", "F8_E8M0", "C64", "BOOL"] * 2 + ["F4", "Q7", "", "f32"]
SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")
SIZES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I64": 8, "F8_E4M3": 1, "F8_E8M0": 1, "C64": 8, "BOOL": 1}


@st.composite
def entries(draw):
    """A header entry that is usually well formed and sometimes lies in one field."""
    code = draw(st.sampled_from(CODES))
    shape = draw(st.lists(st.integers(0, 4) | st.just(-1), max_size=3))
    n = 1
    for d in shape:
        n *= max(d, 0)
    size = n * SIZES.get(code, 1)
    lie = draw(st.sampled_from(["none"] * 12 + ["offsets", "shape_type", "dtype_type", "extra_field"]))
    entry = {"dtype": code, "shape": shape, "size": size}
    if lie == "offsets":
        entry["lie"] = draw(st.tuples(st.integers(-2, 40), st.integers(-2, 40)))
    elif lie == "shape_type":
        entry["shape"] = draw(st.sampled_from(["2", [1.5], [True], None, {"a": 1}]))
    elif lie == "dtype_type":
        entry["dtype"] = draw(st.sampled_from([3, None, ["F32"]]))
    elif lie == "extra_field":
        entry["extra"] = 1
    return entry


@st.composite
def files(draw):
    """Bytes of a safetensors-like file: a header from `entries`, laid out contiguously unless an
    entry lies, then perhaps cut short, padded, or with its length prefix changed."""
    header, offset = {}, 0
    for i, entry in enumerate(draw(st.lists(entries(), max_size=3))):
        begin, end = entry.pop("lie", (offset, offset + entry["size"]))
        offset = max(offset, end)
        entry.pop("size")
        # Names a quantized linear would have, so the loader's FP8/FP4 paths see these headers too.
        name = draw(st.sampled_from([f"t{i}", "l.weight", *(f"l.{k}" for k in SCALES)]))
        header[name] = {**entry, "data_offsets": [begin, end]}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.sampled_from([{"format": "pt"}] * 6 + [{"n": 1}, "x"]))
    body = json.dumps(header).encode()
    if draw(st.integers(0, 19)) == 0:
        body = draw(st.sampled_from([b"[1]", b"{", b"\xff\xfe", b"null", b"[" * 300]))
    length = draw(st.sampled_from([len(body)] * 16 + [0, 7, len(body) + 5, 2**63]))
    data = bytes(range(256)) * (1 + max(offset, 0) // 256)
    raw = struct.pack("<Q", length) + body + data[:max(offset, 0) + draw(st.sampled_from([0] * 8 + [3]))]
    cut = draw(st.sampled_from([None] * 16 + [0, 5, 9, len(raw) - 1]))
    return raw if cut is None else raw[:max(cut, 0)]


def _build(names_shapes):
    model = nn.Module()
    for name, shape in names_shapes:
        owner, _, leaf = name.rpartition(".")
        if owner and not hasattr(model, owner):
            model.add_module(owner, nn.Module())
        (model.get_submodule(owner) if owner else model).register_parameter(
            leaf, nn.Parameter(torch.zeros(shape), requires_grad=False))
    return model


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files())
def test_any_header_opens_reads_and_loads_as_it_says_or_raises_checkpoint_error(raw):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(raw)
        try:
            reader = CheckpointReader(folder)
        except CheckpointError:
            event("refused at open")
            return
        event(f"opened, {len(reader)} tensors")
        with reader:
            for name in reader.names():
                info = reader.info(name)
                try:
                    value = reader.read(name)
                except CheckpointError:
                    assert info.dtype is None, name   # only a dtype this torch cannot hold refuses to read
                    continue
                assert tuple(value.shape) == info.shape and value.dtype == info.dtype
            # A build expecting fp32 tensors of the listed shapes (scales are a weight's companions,
            # not parameters): loads, or says why not.
            build = _build([(n, reader.shape(n)) for n in reader.names() if n.rpartition(".")[2] not in SCALES])
            try:
                load_checkpoint(build, reader)
                event("loaded")
            except CheckpointError:
                event("load refused")

"""The checkpoint reader: single-file and sharded checkpoints read alike, listing costs no tensor data, reads are lazy slices, and broken folders are named precisely."""
import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.reader import CheckpointReader
from tests.runtime import fixtures_checkpoints as fc

REPO = Path(__file__).resolve().parents[2]


def test_a_sharded_checkpoint_with_an_index_reads_like_the_single_file_one():
    # transformers wrote both from the same seeded model: one file, and shards plus an index.
    single, sharded = fc.saved_model("deepseek_v3"), fc.saved_model("deepseek_v3", sharded=True)
    with CheckpointReader(single.path) as one, CheckpointReader(sharded.path) as many:
        assert one.files == ["model.safetensors"]
        assert len(many.files) > 1
        assert one.names() == many.names()
        for name in one.names():
            assert one.info(name).shape == many.info(name).shape
            assert one.dtype(name) == many.dtype(name)
            assert torch.equal(one.read(name), many.read(name)), name
        # And what it reads is what safetensors itself stored.
        stored = fc.read_all(sharded.path)
        assert sorted(stored) == many.names()
        assert all(torch.equal(stored[n], many.read(n)) for n in stored)


def test_listing_names_shapes_and_dtypes_reads_no_tensor_data(tmp_path):
    # A header describing a 4 GiB tensor over a sparse file: opening and listing must cost about
    # nothing in peak memory (a reader that touched the data would add 4 GiB or fail).
    n = 2**30
    header = json.dumps({"big": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
                         "small": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [4 * n, 4 * n + 12]}}).encode()
    file = tmp_path / "model.safetensors"
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * n + 12)
    script = textwrap.dedent(f"""
        from runtime.checkpoint.reader import CheckpointReader
        def hwm():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        before = hwm()
        with CheckpointReader({str(tmp_path)!r}) as r:
            print(r.names(), r.shape("big"), r.dtype("big"), r.shape("small"), r.dtype("small"), hwm() - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    *listed, grown = out.stdout.split()
    assert " ".join(listed) == f"['big', 'small'] ({n},) torch.float32 (2, 3) torch.bfloat16"
    assert int(grown) < 16 * 2**20, f"listing raised peak memory by {int(grown) / 2**20:.1f} MiB"


def test_a_row_slice_reads_only_those_rows(tmp_path):
    # Peak resident memory (VmHWM) of a fresh process: reading 4 rows of a 128 MiB tensor must not
    # raise it by more than a few MiB, while reading the whole tensor raises it by the tensor's size
    # (which shows the measurement would catch a reader that materialises the tensor).
    rows, cols = 4096, 8192
    save_file({"big": torch.ones(rows, cols), "small": torch.ones(8, 8)}, str(tmp_path / "model.safetensors"))
    script = textwrap.dedent(f"""
        import torch
        from runtime.checkpoint.reader import CheckpointReader
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        r = CheckpointReader({str(tmp_path)!r})
        r.read("small", (slice(0, 1),))  # warm up the code paths on a tensor too small to matter
        before = hwm()
        part = r.read("big", (slice(100, 104),))
        sliced = hwm() - before
        assert part.shape == (4, {cols}) and bool((part == 1).all())
        assert part.untyped_storage().nbytes() == 4 * {cols} * 4
        before = hwm()
        whole = r.read("big")
        print(sliced, hwm() - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    sliced, whole = map(int, out.stdout.split())
    assert sliced < 8 * 2**20, f"a 128 KiB row slice raised peak memory by {sliced / 2**20:.1f} MiB"
    assert whole > 100 * 2**20, f"reading the whole 128 MiB tensor raised peak memory by only {whole / 2**20:.1f} MiB"


def test_a_slice_outside_the_tensor_is_refused_not_clamped():
    with CheckpointReader(fc.saved_model("mixtral").path) as r:
        name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
        with pytest.raises(CheckpointError) as e:
            r.read(name, (slice(30, 40),))
        assert str(e.value) == f"{name}: slice 30:40:1 out of range for dim 0 of size 32"
        assert r.read(name, (slice(30, 32), slice(0, 8))).shape == (2, 8)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_shard_file_missing_from_the_folder_is_named_with_the_index_that_references_it(tmp_path):
    path = _copy(fc.saved_model("deepseek_v3", sharded=True).path, tmp_path / "ckpt")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    gone = "model-00002-of-00006.safetensors"
    (path / gone).unlink()
    in_gone = sorted(n for n, f in weight_map.items() if f == gone)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    assert str(e.value) == (f"missing shard file {gone} referenced by model.safetensors.index.json "
                            f"({len(in_gone)} tensors, e.g. {in_gone[0]})")


def test_an_index_entry_that_its_shard_does_not_hold_is_named(tmp_path):
    path = _copy(fc.saved_model("deepseek_v3", sharded=True).path, tmp_path / "ckpt")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.7.mlp.gate.weight"] = "model-00001-of-00006.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    assert str(e.value) == ("model.safetensors.index.json puts model.layers.7.mlp.gate.weight in "
                            "model-00001-of-00006.safetensors, but that file has no such tensor")


def _library_says(file: Path) -> str:
    """What the safetensors library itself says of `file` (the oracle: it validates, the reader names the file)."""
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except SafetensorError as e:
        return str(e).removeprefix("Error while deserializing header: ")
    raise AssertionError(f"safetensors reads {file}")


def _refusal(folder: Path, file: str) -> str:
    return (f"{file} in {folder} is not a readable safetensors file ({_library_says(folder / file)}); "
            f"download or write it again")


def test_a_truncated_file_is_reported_when_the_checkpoint_is_opened(tmp_path):
    path = _copy(fc.saved_model("qwen3_moe").path, tmp_path / "ckpt")
    file = path / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    assert str(e.value) == _refusal(path, "model.safetensors")
    assert "not fully covered" in str(e.value)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _raw(header) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body


# name -> (file bytes, a fixed part of the library's reason that says what is wrong)
LYING_FILES = {
    "shorter_than_8_bytes": (b"\x10\x00\x00", "header too small"),
    "header_length_beyond_the_file": (struct.pack("<Q", 4096) + b"{}", "invalid header length"),
    "header_not_json": (_raw(b"{not json}"), "invalid JSON in header"),
    "header_not_an_object": (_raw([1, 2, 3]), "invalid JSON in header"),
    "unknown_dtype_code": (_raw({"a": _entry(dtype="Q7", offsets=(0, 2))}) + bytes(2), "unknown variant `Q7`"),
    "offsets_past_the_end": (_raw({"a": _entry()}) + bytes(4), "not fully covered"),
    "overlapping_offsets": (_raw({"a": _entry(), "b": _entry(offsets=(4, 12))}) + bytes(12), "invalid offset for tensor `b`"),
    "size_not_shape_times_dtype": (_raw({"a": _entry(shape=(3,))}) + bytes(8), "invalid shape, data type, or offset"),
    "negative_dim": (_raw({"a": _entry(shape=(-2,))}) + bytes(8), "invalid value: integer `-2`"),
    "trailing_bytes": (_raw({"a": _entry()}) + bytes(12), "not fully covered"),
}


@pytest.mark.parametrize("case", sorted(LYING_FILES))
def test_a_safetensors_file_whose_header_lies_is_refused_naming_the_file(tmp_path, case):
    content, says = LYING_FILES[case]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == _refusal(tmp_path, "model.safetensors")
    assert says in str(e.value)


def test_a_lying_shard_is_named_among_the_others(tmp_path):
    path = _copy(fc.saved_model("deepseek_v3", sharded=True).path, tmp_path / "ckpt")
    shard = "model-00003-of-00006.safetensors"
    (path / shard).write_bytes(_raw({"a": _entry(shape=(3,))}) + bytes(8))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    assert str(e.value) == _refusal(path, shard)


BAD_INDEXES = {
    "not_json": (b"{", "is not readable JSON: "),
    "not_utf8": (b'{"weight_map": {"a": "\xff.safetensors"}}', "is not readable JSON: 'utf-8' codec can't decode"),
    "a_list": (b"[]", "must hold a JSON object, found list"),
    "weight_map_a_list": (b'{"weight_map": []}',
                          "is not a safetensors index: its weight_map must be an object of tensor names to shard file names"),
    "shard_name_a_number": (b'{"weight_map": {"a": 3}}',
                            "is not a safetensors index: its weight_map must be an object of tensor names to shard file names"),
    "shard_outside_the_folder": (b'{"weight_map": {"a": "../model.safetensors"}}',
                                 "names shard '../model.safetensors', which is not a file name in "),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_a_malformed_index_is_refused_naming_it(tmp_path, case):
    content, says = BAD_INDEXES[case]
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_bytes(content)
    # A valid file one level up: an index that could point at it must not read it.
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(index.parent)
    assert str(e.value).startswith(f"{index} {says}")
    if case == "shard_outside_the_folder":
        assert str(e.value) == f"{index} {says}{index.parent}"


def test_a_folder_where_the_checkpoint_file_belongs_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == f"{tmp_path / 'model.safetensors'} is not a file (a folder or a broken link)"


@pytest.mark.parametrize("content, says", [(b"\xff\xfe", "is not readable JSON: 'utf-8' codec can't decode"),
                                           (b'"text"', "must hold a JSON object, found str"),
                                           (b"[" * 100_000, "is not readable JSON: ")])
def test_a_config_that_is_not_a_json_object_is_refused_naming_it(tmp_path, content, says):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes(content)
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError) as e:
        r.config
    assert str(e.value).startswith(f"{tmp_path / 'config.json'} {says}")


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == f"no model.safetensors or model.safetensors.index.json in {tmp_path}"


def test_quant_metadata_comes_back_as_the_json_the_producer_wrote():
    nv = fc.qwen3_moe_nvfp4()
    with CheckpointReader(nv.path) as r:
        assert r.hf_quant_config == json.loads((nv.path / "hf_quant_config.json").read_text())
        assert r.hf_quant_config["quantization"]["quant_algo"] == "NVFP4"
        assert r.quantization_config["quant_method"] == "modelopt"
    with CheckpointReader(fc.deepseek_fp8().path) as r:
        assert r.quantization_config["weight_block_size"] == [128, 128]
        assert r.hf_quant_config is None
    with CheckpointReader(fc.gpt_oss_mxfp4().path) as r:
        assert r.quantization_config["quant_method"] == "mxfp4"
        assert r.config["model_type"] == "gpt_oss"
    with CheckpointReader(fc.saved_model("mixtral").path) as r:
        assert r.quantization_config is None and r.hf_quant_config is None

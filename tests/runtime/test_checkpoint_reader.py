"""The checkpoint reader: single-file and sharded checkpoints read alike, listing costs no tensor data, reads are lazy slices, and broken folders are named precisely."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.checkpoint import reader as reader_module
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


def test_listing_names_shapes_and_dtypes_opens_no_tensor_data(monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("listing must come from the headers")

    monkeypatch.setattr(reader_module, "safe_open", no_data)
    with CheckpointReader(fc.saved_model("qwen3_moe", sharded=True).path) as r:
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        assert name in r
        assert r.info(name).shape == (fc.HIDDEN, fc.MOE_INTER)
        assert r.dtype(name) == torch.bfloat16
        assert r.names("model.layers.1.mlp.experts.3.") == [
            "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight"]


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


def test_a_truncated_file_is_reported_when_the_checkpoint_is_opened(tmp_path):
    path = _copy(fc.saved_model("qwen3_moe").path, tmp_path / "ckpt")
    file = path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    assert str(e.value) == (f"model.safetensors is truncated: its header describes {size} bytes, "
                            f"the file has {size - 10}")


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

"""`import-checkpoint` treats the folder as untrusted input (issue 10 §1; RULES GN4): names are checked
before anything is written, nothing lands outside `--out`, config keys and folder names cannot inject
TOML, and every malformed file is one message with exit 2.

Checkpoints here are config.json plus a real safetensors file (written by safetensors itself) of one
small tensor: the import reads headers only, so no weights are needed.
"""

from __future__ import annotations

import json
import struct
import tomllib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from registry.declarations import MODELS_DIR, load_declaration
from tests.codegen.helpers import cli, snapshot

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": None, "sliding_window": None, "rms_norm_eps": 1e-5,
}


def checkpoint(folder: Path, config: dict | None = None, **files) -> Path:
    """A checkpoint folder: config.json (MIXTRAL unless given), one safetensors file, extra files (bytes or dicts as JSON)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MIXTRAL if config is None else config), encoding="utf-8")
    save_file({"model.embed_tokens.weight": np.ones((96, 64), dtype=np.float32)}, str(folder / "model.safetensors"))
    for name, content in files.items():
        name = name.replace("__", ".")
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        (folder / name).write_bytes(data)
    return folder


def refused(capsys, *args) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr and nothing on stdout."""
    code, out, err = cli(capsys, "import-checkpoint", *args)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.removeprefix("error: ").removesuffix("\n")


# --- names and writes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "../mixtral_8x7b", "My-Model", "a b", "x\n[targets]", ""])
def test_a_name_that_is_not_a_token_is_refused_before_anything_is_written(capsys, tmp_path, name):
    folder = checkpoint(tmp_path / "ckpt")
    before, project = snapshot(tmp_path), snapshot(MODELS_DIR)
    assert refused(capsys, folder, "--name", name, "--out", tmp_path / "out" / f"{name}.toml") == (
        f"--name {name!r} is not a model name: use lowercase letters, digits and _, starting with a letter "
        "(a name is a file name and a Python identifier)"
    )
    assert snapshot(tmp_path) == before and snapshot(MODELS_DIR) == project


def test_a_project_model_name_is_refused_and_its_declaration_left_alone(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    project = snapshot(MODELS_DIR)
    assert refused(capsys, folder, "--out", MODELS_DIR / "mixtral_8x7b.toml") == (
        "model 'mixtral_8x7b' is a project declaration (registry/models/mixtral_8x7b.toml); pass --name with another name"
    )
    assert refused(capsys, folder, "--name", "tiny_mixtral") == (
        "model 'tiny_mixtral' is a project declaration (registry/models/tiny_mixtral.toml); pass --name with another name"
    )
    assert snapshot(MODELS_DIR) == project


def test_out_must_be_a_toml_file_named_as_the_model(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    assert refused(capsys, folder, "--name", "mine", "--out", tmp_path / "other.toml") == (
        f"--out {tmp_path / 'other.toml'}: a declaration's file name is its model name; write it to {tmp_path / 'mine.toml'}"
    )
    assert refused(capsys, folder, "--out", tmp_path / "mine.txt") == (
        f"--out {tmp_path / 'mine.txt'}: a declaration file ends in .toml (generate --models reads only *.toml)"
    )
    (tmp_path / "dir.toml").mkdir()
    assert refused(capsys, folder, "--out", tmp_path / "dir.toml") == (
        f"--out {tmp_path / 'dir.toml'}: a directory; name the declaration file, e.g. {tmp_path / 'dir.toml' / 'dir.toml'}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "dir.toml"]


def test_a_folder_name_that_makes_no_model_name_asks_for_name(capsys, tmp_path):
    folder = checkpoint(tmp_path / "7-Model")
    assert refused(capsys, folder) == "the folder name '7-Model' makes no model name ('7_model'); pass --name N"


def test_the_declaration_is_written_only_to_out_and_loads_as_written(capsys, tmp_path):
    folder = checkpoint(tmp_path / "My-Mixtral.v1")
    out = tmp_path / "models" / "my_mixtral_v1.toml"
    code, stdout, err = cli(capsys, "import-checkpoint", folder, "--out", out)
    assert (code, stdout, err) == (0, f"wrote {out}: layers 0-1: bf16\n", "")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "My-Mixtral.v1", "My-Mixtral.v1/config.json", "My-Mixtral.v1/model.safetensors", "models", "models/my_mixtral_v1.toml"]
    decl = load_declaration(out)
    assert (decl.model.name, decl.model.doc, decl.checkpoints[0].name, decl.targets) == (
        "my_mixtral_v1", "Imported from My-Mixtral.v1.", "my_mixtral_v1", ())
    # Nulls are left out (head_dim and sliding_window read as Mixtral's defaults, as transformers reads them).
    assert decl.config == {k: v for k, v in MIXTRAL.items() if v is not None}


# --- TOML injection -------------------------------------------------------------------------------

INJECTED = '"\n[[targets]]\ncheckpoint = "m"\nsm = 90\nparallel = "tp1"\nmoe_impls_honored = "*"\n#'


def test_config_keys_values_and_the_folder_name_cannot_inject_toml(capsys, tmp_path):
    # Keys the family does not read are kept in the TOML (and dropped when it loads); values the family
    # reads are typed, so an injected string there is refused before anything is written (next test).
    config = MIXTRAL | {f"x{INJECTED}": 1, f"y{INJECTED}": {f"k{INJECTED}": f"v{INJECTED}"}}
    folder = checkpoint(tmp_path / f"ckpt{INJECTED}", config)
    out = tmp_path / "m.toml"
    assert cli(capsys, "import-checkpoint", folder, "--out", out)[0] == 0
    data = tomllib.loads(out.read_text(encoding="utf-8"))
    assert "targets" not in data
    assert data["config"][f"x{INJECTED}"] == 1
    assert data["config"][f"y{INJECTED}"] == {f"k{INJECTED}": f"v{INJECTED}"}
    assert data["model"]["doc"] == f"Imported from ckpt{INJECTED}."
    # The comments name only the validated model name, never the folder.
    assert [line for line in out.read_text().splitlines() if line.startswith("#")][:2] == [
        "# m: imported by `python -m codegen import-checkpoint` (model.doc names the folder).",
        "# Quant metadata: none (unquantized); 1 tensors in the safetensors headers.",
    ]



def test_an_injected_string_in_a_value_the_family_reads_is_refused_before_any_write(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt", MIXTRAL | {"hidden_act": f"silu{INJECTED}"})
    out = tmp_path / "out" / "m.toml"
    code, stdout, err = cli(capsys, "import-checkpoint", folder, "--out", out, "--name", "m")
    assert (code, stdout) == (2, "")
    assert err == (f"error: the declaration of {folder / 'config.json'}:11: config.hidden_act: Input should be 'silu', "
                   "not a string 'silu\"\\n[[targets]]\\ncheckpoint = \"m\"...\n")
    assert not (tmp_path / "out").exists()


NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
    "hybrid_override_pattern": "ME", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "n_groups": 2, "mamba_num_heads": 4,
    # As transformers 5's save_pretrained writes the default (0.0, inf): JSON has no infinity.
    "time_step_limit": [0.0, {"__float__": "Infinity"}],
}


def test_a_mamba_step_limit_as_transformers_saves_it_imports_and_a_real_bound_is_refused(capsys, tmp_path):
    code, _, err = cli(capsys, "import-checkpoint", checkpoint(tmp_path / "ok", NEMOTRON_H), "--out", tmp_path / "ok.toml")
    assert code == 0, err
    assert load_declaration(tmp_path / "ok.toml").config["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    # A bound the scan would ignore (runtime/ops/mamba.py runs dt unbounded) is refused, not dropped.
    folder = checkpoint(tmp_path / "bound", NEMOTRON_H | {"time_step_limit": [0.0, 0.1]})
    assert refused(capsys, folder, "--name", "m", "--out", tmp_path / "out" / "m.toml").endswith(
        "config.time_step_limit: time_step_limit [0.0, 0.1] bounds Mamba-2's step dt; moegen's scan runs it "
        "unbounded, (0, inf), as vLLM runs these checkpoints: set [0.0, inf] or remove the key"
    )
    assert not (tmp_path / "out").exists()


# --- nulls ----------------------------------------------------------------------------------------


def test_a_null_that_changes_the_model_is_refused_naming_the_key(capsys, tmp_path):
    # transformers reads a null rms_norm_eps as None (no epsilon); left out it would read as 1e-5.
    folder = checkpoint(tmp_path / "ckpt", MIXTRAL | {"rms_norm_eps": None})
    assert refused(capsys, folder, "--name", "m") == (
        "config.json sets head_dim, rms_norm_eps, sliding_window to null; a declaration cannot state null (TOML has none) "
        "and leaving it out changes what the mixtral build inlines (rms_norm_eps): this checkpoint is not supported"
    )


def test_a_null_inside_a_list_is_refused(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt", MIXTRAL | {"layer_types": ["full_attention", None]})
    assert refused(capsys, folder, "--name", "m") == "config.json: layer_types holds null, which a declaration cannot state (TOML has no null)"


# --- malformed files ------------------------------------------------------------------------------


def _config_path(tmp_path):
    return tmp_path / "ckpt" / "config.json"


@pytest.mark.parametrize("content, message", [
    (b'{"a": "\xff"}', "{path}: not UTF-8 text (byte 0xff at offset 7); save it as UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "{path}: nested more than 32 levels deep, deeper than any file moegen reads"),
    (b'{"a": ' + b'{"b": ' * 40 + b"1" + b"}" * 41, "{path}: nested more than 32 levels deep, deeper than any file moegen reads"),
    (b'["MixtralForCausalLM"]', "{path}: holds an array, where a JSON object belongs"),
    (b'{"hidden_size": NaN}', "{path}: not valid JSON: NaN is not a JSON number"),
    (b'{"architectures": "MixtralForCausalLM"}', "{path}: architectures is a string, where a list of class names belongs"),
    (b'{"architectures": ["MixtralForCausalLM"], "quantization_config": ["fp8"]}', "{path}: quantization_config is an array, where an object belongs"),
    (b'{"architectures": ["MixtralForCausalLM"], "quantization_config": {"quant_method": 8}}',
     "{path}: quantization_config.quant_method is a number, where a string belongs"),
    (b'{"architectures": ["MixtralForCausalLM"], "quantization_config": {"quant_method": "fp8", "weight_block_size": "128"}}',
     "{path}: quantization_config.weight_block_size is '128', where two block edges [rows, columns] belong"),
    (b'{"architectures": ["MixtralForCausalLM"], "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}}',
     "{path}: quantization_config.modules_to_not_convert is a string, where an array belongs"),
    (b'{"architectures": ["MixtralForCausalLM"], "quantization_config": {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}}',
     "{path}: quantization_config.quant_algo 'INT4_AWQ' is not one moegen reads; known: FP8_BLOCK_SCALES, NVFP4, W4A16_NVFP4, "
     "MXFP4, W4A16_MXFP4, MIXED_PRECISION"),
])
def test_a_malformed_config_json_is_one_message(capsys, tmp_path, content, message):
    folder = checkpoint(tmp_path / "ckpt")
    _config_path(tmp_path).write_bytes(content)
    assert refused(capsys, folder, "--name", "m") == message.format(path=_config_path(tmp_path))


def test_a_config_json_that_is_a_directory_a_dangling_link_or_missing_is_one_message(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    path = _config_path(tmp_path)
    path.unlink()
    assert refused(capsys, folder, "--name", "m") == f"{path}: missing; a checkpoint folder has a config.json"
    path.symlink_to(tmp_path / "nowhere.json")
    assert refused(capsys, folder, "--name", "m") == f"{path}: a symbolic link to {tmp_path / 'nowhere.json'}, which does not exist"
    path.unlink()
    path.mkdir()
    assert refused(capsys, folder, "--name", "m") == f"{path}: a directory, where a file belongs"
    assert refused(capsys, tmp_path / "absent", "--name", "m") == f"{tmp_path / 'absent'}: not a checkpoint folder (not a folder)"


@pytest.mark.parametrize("content, message", [
    ({"quantization": ["NVFP4"]}, "{path}: quantization is an array, where an object belongs"),
    ({"quantization": {"quant_algo": 4}}, "{path}: quantization.quant_algo is a number, where a string belongs"),
    ({"quantization": {"quant_algo": "INT8_SQ"}},
     "{path}: quantization.quant_algo 'INT8_SQ' is not one moegen reads; known: FP8_BLOCK_SCALES, NVFP4, W4A16_NVFP4, MXFP4, "
     "W4A16_MXFP4, MIXED_PRECISION"),
    ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head", 3]}},
     "{path}: quantization.exclude_modules holds a number, where only module names (strings) belong"),
    ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"model.layers.0.mlp.experts": "NVFP4"}}},
     "{path}: quantization.quantized_layers['model.layers.0.mlp.experts'] is a string, where an object belongs"),
    (b"\x00\x01", "{path}: not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_malformed_hf_quant_config_is_one_message(capsys, tmp_path, content, message):
    folder = checkpoint(tmp_path / "ckpt", hf_quant_config__json=content)
    assert refused(capsys, folder, "--name", "m") == message.format(path=folder / "hf_quant_config.json")


def test_a_per_layer_algorithm_of_an_expert_layer_that_moegen_does_not_read_is_refused_at_import(capsys, tmp_path):
    # Entries may name attention modules in FP8 (moegen builds attention in bf16); on experts they must be known.
    layers = {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}, "model.layers.1.block_sparse_moe.experts.*": {"quant_algo": "INT4_AWQ"}}
    folder = checkpoint(tmp_path / "ckpt", hf_quant_config__json={"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}})
    assert refused(capsys, folder, "--name", "m") == (
        f"{folder}: layer 1's experts are per-layer entry 'model.layers.1.block_sparse_moe.experts.*': INT4_AWQ, an algorithm "
        "moegen does not read; known: FP8_BLOCK_SCALES, NVFP4, W4A16_NVFP4, MXFP4, W4A16_MXFP4"
    )


# --- safetensors headers and the index -------------------------------------------------------------


def _header_file(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02", "{path}: 2 bytes, shorter than a safetensors header length (8 bytes)"),
    (struct.pack("<Q", 10**6) + b"{}", "{path}: the header claims 1000000 bytes, but the file has 2 after its length"),
    (struct.pack("<Q", 3) + b"{x}", "{path}: header: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (struct.pack("<Q", 2) + b"[]", "{path}: header: holds an array, where a JSON object belongs"),
    (struct.pack("<Q", 2) + b"\xfe\xff", "{path}: header: not UTF-8 text (byte 0xfe at offset 0); save it as UTF-8"),
    (_header_file({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "{path}: tensor 'w': dtype 'F33' is not a safetensors dtype code; known: BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, "
     "F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64"),
    (_header_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, b"\0" * 8),
     "{path}: tensor 'w': data_offsets [0, 80] do not lie in the file's 8 data bytes"),
    (_header_file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     "{path}: tensor 'w': F32 [3] takes 12 bytes, but its data_offsets span 8"),
    (_header_file({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8), "{path}: tensor 'w': shape '2' is not a list of sizes"),
    (_header_file({"w": [1]}), "{path}: tensor 'w' is an array, where an object belongs"),
])
def test_a_safetensors_file_whose_header_lies_is_refused_naming_it(capsys, tmp_path, content, message):
    folder = checkpoint(tmp_path / "ckpt", **{"extra__safetensors": content})
    assert refused(capsys, folder, "--name", "m") == message.format(path=folder / "extra.safetensors")


def test_a_safetensors_entry_that_is_a_directory_or_a_dangling_link_is_one_message(capsys, tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    (folder / "a.safetensors").mkdir()
    assert refused(capsys, folder, "--name", "m") == f"{folder / 'a.safetensors'}: a directory, where a file belongs"
    (folder / "a.safetensors").rmdir()
    (folder / "a.safetensors").symlink_to(tmp_path / "gone")
    assert refused(capsys, folder, "--name", "m") == f"{folder / 'a.safetensors'}: a symbolic link to {tmp_path / 'gone'}, which does not exist"


@pytest.mark.parametrize("index, message", [
    (["model.safetensors"], "{path}: holds an array, where a JSON object belongs"),
    ({"weight_map": ["model.safetensors"]}, "{path}: weight_map is an array, where an object (tensor -> file) belongs"),
    ({"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}},
     "{path}: weight_map puts 'model.embed_tokens.weight' in '../../etc/passwd', which is not a .safetensors file of this folder"),
    ({"weight_map": {"lm_head.weight": "model.safetensors"}},
     "{path}: weight_map puts 'lm_head.weight' in 'model.safetensors', whose header has no such tensor"),
])
def test_a_malformed_safetensors_index_is_one_message(capsys, tmp_path, index, message):
    folder = checkpoint(tmp_path / "ckpt", **{"model__safetensors__index__json": index})
    assert refused(capsys, folder, "--name", "m") == message.format(path=folder / "model.safetensors.index.json")


@pytest.mark.parametrize("bad", [{"hidden_size": "64"}, {"num_hidden_layers": "2"}, {"num_attention_heads": [4]}, {"rope_scaling": "yarn"}])
def test_a_value_of_the_wrong_kind_in_config_json_is_one_message_about_the_declaration(capsys, tmp_path, bad):
    # The declaration loader types [config] (its own tests assert each key's message); whatever it says,
    # the import says it once, about the declaration of this config.json.
    folder = checkpoint(tmp_path / "ckpt", MIXTRAL | bad)
    assert refused(capsys, folder, "--name", "m").startswith(f"the declaration of {folder / 'config.json'}:")


# --- property: whatever the folder holds, a declaration that loads or one message ------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_HEADER_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "U8", "F4", "F33", 7]),
    "shape": st.lists(st.integers(-1, 4), max_size=3) | _JSON,
    "data_offsets": st.lists(st.integers(-2, 40), min_size=0, max_size=3) | _JSON,
})


def _outcome(capsys, tmp_path, folder):
    out = tmp_path / "out" / "m.toml"
    outside = snapshot(tmp_path / "ckpt"), snapshot(MODELS_DIR)
    code, stdout, err = cli(capsys, "import-checkpoint", folder, "--out", out)
    assert (snapshot(tmp_path / "ckpt"), snapshot(MODELS_DIR)) == outside   # nothing written but --out
    if code == 0:
        load_declaration(out)
        out.unlink()
    else:
        assert (code, stdout) == (2, "") and err.startswith("error: ") and err.count("\n") == 1, err
        assert not out.exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(sorted(MIXTRAL)), _JSON, max_size=3), extra=st.dictionaries(st.text(max_size=10), _JSON, max_size=2))
def test_any_config_json_values_give_a_loadable_declaration_or_one_message(capsys, tmp_path, values, extra):
    _outcome(capsys, tmp_path, checkpoint(tmp_path / "ckpt", MIXTRAL | values | extra))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.dictionaries(st.text(max_size=6), _HEADER_ENTRY | _JSON, max_size=3), data=st.binary(max_size=24),
       length=st.none() | st.integers(0, 2**64 - 1))
def test_any_safetensors_header_gives_a_loadable_declaration_or_one_message(capsys, tmp_path, entries, data, length):
    _outcome(capsys, tmp_path, checkpoint(tmp_path / "ckpt", **{"extra__safetensors": _header_file(entries, data, length)}))

"""`import-checkpoint`: write the declaration of a checkpoint folder (config, quant metadata, drafts).

No torch: safetensors headers are JSON (an 8-byte length, then the header), so the tensor names,
dtypes and shapes are read without loading any data. Everything read is untrusted: names are checked
before anything is written, the TOML is written by tomlkit (never pasted), and the declaration is
validated by the project's own loader before it reaches `--out`. The declaration it writes has no
targets: the user adds the ones they deploy, starting from the suggested one.
"""

from __future__ import annotations

import math
import re
import struct
import tempfile
import tomllib
from pathlib import Path

import tomlkit

from codegen.modelspec import normalize
from families import RUNTIME_FAMILIES, family_for_architecture
from registry.checkpoint_config import published_config
from registry.configs import ConfigError, validate_config
from registry.declarations import MODELS_DIR, TOKEN, Declaration, load_declaration
from registry.errors import DeclarationError
from registry.formats import CHECKPOINT_ALGOS, CheckpointQuant
from registry.impls import load_registry
from registry.inputs import kind, parse_json, read_bytes, read_json, text_of_path
from registry.layer_task import span
from registry.quant_meta import read_checkpoint_quant, read_config

# The safetensors format's dtype codes and their widths in bits (the format's own table).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
INDEX_FILE = "model.safetensors.index.json"
# The format caps a header at 100 MB; a larger length is not a safetensors header.
_MAX_HEADER = 100 * 1024 * 1024


def _shown(key: str) -> str:
    """A config key in a message: as is when plain, else quoted (a key may hold a newline)."""
    return key if re.fullmatch(r"[A-Za-z0-9_.\[\]]+", key) else repr(key)


def _check_name(name: str, where: str) -> str:
    if not re.fullmatch(TOKEN, name):
        raise DeclarationError(
            f"{where} {name!r} is not a model name: use lowercase letters, digits and _, starting with a letter "
            "(a name is a file name and a Python identifier)"
        )
    return name


def model_name(folder: Path, name: str | None, out: Path | None) -> str:
    """The model name, checked before anything is read or written: `--name`, else `--out`'s file name,
    else the folder's name; a declaration's model name equals its file name."""
    if name is not None:
        _check_name(name, "--name")
    if out is not None and out.suffix != ".toml":
        raise DeclarationError(f"--out {out}: a declaration file ends in .toml (generate --models reads only *.toml)")
    if name is not None:
        if out is not None and out.stem != name:
            raise DeclarationError(f"--out {out}: a declaration's file name is its model name; write it to {out.with_name(name + '.toml')}")
    elif out is not None:
        name = _check_name(out.stem, "--out file name")
    else:
        derived = folder.resolve().name.lower().replace("-", "_").replace(".", "_")
        if not re.fullmatch(TOKEN, derived):
            raise DeclarationError(f"the folder name {folder.resolve().name!r} makes no model name ({derived!r}); pass --name N")
        name = derived
    if (MODELS_DIR / f"{name}.toml").exists():
        raise DeclarationError(f"model {name!r} is a project declaration (registry/models/{name}.toml); pass --name with another name")
    if out is not None and out.is_dir():
        raise DeclarationError(f"--out {out}: a directory; name the declaration file, e.g. {out / (name + '.toml')}")
    return name


def safetensors_header(path: Path) -> dict[str, dict]:
    """One file's tensors (dtype, shape) from its header, every field checked against the file."""
    data_size = _file_size(path)
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise DeclarationError(f"{path}: {len(head)} bytes, shorter than a safetensors header length (8 bytes)")
        (size,) = struct.unpack("<Q", head)
        if size > min(data_size - 8, _MAX_HEADER):
            raise DeclarationError(f"{path}: the header claims {size} bytes, but the file has {data_size - 8} after its length")
        header = parse_json(handle.read(size), f"{path}: header", what="JSON")
    body = data_size - 8 - size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise DeclarationError(f"{where} is {kind(entry)}, where an object belongs")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in DTYPE_BITS:
            raise DeclarationError(f"{where}: dtype {code!r} is not a safetensors dtype code; known: {', '.join(DTYPE_BITS)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise DeclarationError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= body):
            raise DeclarationError(f"{where}: data_offsets {offsets!r} do not lie in the file's {body} data bytes")
        bits = math.prod(shape) * DTYPE_BITS[code]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise DeclarationError(f"{where}: {code} {shape} takes {bits / 8:g} bytes, but its data_offsets span {offsets[1] - offsets[0]}")
        tensors[name] = {"dtype": code, "shape": shape}
    return tensors


def _file_size(path: Path) -> int:
    if not path.is_file():
        read_bytes(path, str(path))   # raises the message every input gets for a directory or dangling link
    return path.stat().st_size


def tensor_headers(folder: Path) -> dict[str, dict]:
    """Every tensor's dtype and shape, from the safetensors headers (no tensor data is read); a
    sharded checkpoint's index must name only files of the folder, each holding what it says."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DeclarationError(f"{folder}: no *.safetensors files")
    headers: dict[str, dict] = {}
    by_file = {}
    for path in files:
        by_file[path.name] = safetensors_header(path)
        headers.update(by_file[path.name])
    index = folder / INDEX_FILE
    if index.exists() or index.is_symlink():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DeclarationError(f"{index}: weight_map is {kind(weight_map)}, where an object (tensor -> file) belongs")
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or file not in by_file:
                raise DeclarationError(f"{index}: weight_map puts {tensor!r} in {file!r}, which is not a .safetensors file of this folder")
            if tensor not in by_file[file]:
                raise DeclarationError(f"{index}: weight_map puts {tensor!r} in {file!r}, whose header has no such tensor")
    return headers


def _toml(value, key: str):
    """A config value as a tomlkit item: tables inline (as declarations are written), nulls inside
    tables left out (the null check below compares what that means); a null in a list has no TOML."""
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        table.update({k: _toml(v, f"{key}.{k}") for k, v in value.items() if v is not None})
        return table
    if isinstance(value, list):
        if any(v is None for v in value):
            raise DeclarationError(f"config.json: {_shown(key)} holds null, which a declaration cannot state (TOML has no null)")
        array = tomlkit.array()
        array.extend(_toml(v, f"{key}[{n}]") for n, v in enumerate(value))
        return array
    return value


def config_body(config: dict, family: str) -> dict:
    """The [config] table as written: published names, sorted, nulls left out (see `check_nulls`)."""
    return {k: v for k, v in sorted(published_config(config, family).items()) if v is not None}


def declaration_config(config: dict, family: str) -> dict:
    """The [config] table, once its nulls are known to mean what leaving them out means."""
    body = config_body(config, family)
    check_nulls(published_config(config, family), body, family)
    return body


def check_nulls(full: dict, body: dict, family: str) -> None:
    """A null in config.json is what transformers reads (None, which its model code then defaults, as
    Mixtral's `head_dim` or `sliding_window`); TOML has no null, so the key is left out, which reads as
    the family default. Accepted when both build the same model, refused when not (a DeepSeek-V3 with
    `q_lora_rank` null has no query LoRA, while the default has one)."""
    nulls = sorted(k for k, v in full.items() if v is None)
    if not nulls:
        return
    # A null the family's typed config refuses (transformers has no null there) means no value the
    # build can inline; the others are compared by what the build inlines with and without them.
    refused = {k for k in nulls if not _reads_null(family, body, k)}
    readable = {k: v for k, v in full.items() if k not in refused}
    built, meant = normalize(family, body), normalize(family, readable)
    changed = sorted(refused | {k for k in set(meant) | set(built) if meant.get(k) != built.get(k)})
    if changed:
        raise DeclarationError(
            f"config.json sets {', '.join(map(_shown, nulls))} to null; a declaration cannot state null (TOML has none) and "
            f"leaving it out changes what the {family} build inlines ({', '.join(map(_shown, changed))}): this checkpoint is not supported"
        )


def _reads_null(family: str, body: dict, key: str) -> bool:
    try:
        validate_config(family, body | {key: None})
    except ConfigError:
        return False
    return True


def _suggested_target(decl: Declaration) -> list[str]:
    """A target that runs where the README's snippet runs, the host CPU: the TORCH implementations of
    its layers' formats on sm_90, with backend TORCH (AUTO would bind sm_90's GPU-only kernels)."""
    registry = load_registry()
    facts = decl.facts()

    def ids(sites):
        formats = set()
        for site in sites:
            formats |= set(registry.mxfp4_preference(90) or ()) if site.format.format == "mxfp4" else {site.format.format}
        return sorted(str(i.id) for i in registry.impls if i.backend == "TORCH" and i.cpu and i.runs_on(90) and i.format in formats)

    lines = ["", "# No targets yet: add one per deployment. This one runs on the host CPU too (TORCH does; the CUPY",
             "# kernels are sm_90 GPU only), as `load_model(..., moe_config={\"backend\": \"TORCH\"})` asks:",
             "# [[targets]]", f"# checkpoint = \"{decl.checkpoints[0].name}\"", "# sm = 90", '# parallel = "tp1"',
             f"# moe_impls_honored = {tomlkit.item(ids(facts.sites)).as_string()}"]
    draft_sites = [s for d in facts.drafts for s in d.sites]
    if draft_sites:
        lines.append(f"# draft_moe_impls_honored = {tomlkit.item(ids(draft_sites)).as_string()}")
    lines.append('# selection = { backend = "TORCH" }')
    return lines


def render_declaration(folder: Path, name: str, body: dict, family, quant: CheckpointQuant, source: str, headers: dict) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"{name}: imported by `python -m codegen import-checkpoint` (model.doc names the folder)."))
    doc.add(tomlkit.comment(f"Quant metadata: {'none (unquantized)' if source == 'none' else f'read from {source}'}; "
                            f"{len(headers)} tensors in the safetensors headers."))
    doc.add(tomlkit.nl())
    doc.add("model", tomlkit.item({"name": name, "family": family.name, "doc": f"Imported from {text_of_path(folder.resolve().name)}."}))
    doc.add(tomlkit.nl())
    table = tomlkit.table()
    for key, value in body.items():
        table[key] = _toml(value, key)
    doc.add("config", table)
    doc.add(tomlkit.nl())
    checkpoint = {"name": name, "doc": "Unquantized (no quant metadata)." if source == "none" else f"Quant metadata read from {source}."}
    if quant.quant_algo:
        checkpoint["quant_algo"] = quant.quant_algo
    if quant.exclude_modules:
        checkpoint["exclude_modules"] = list(quant.exclude_modules)
    if quant.quantized_layers:
        checkpoint["quantized_layers"] = _toml(dict(quant.quantized_layers), "quantized_layers")
    doc.add("checkpoints", tomlkit.aot())
    doc["checkpoints"].append(tomlkit.item(checkpoint))
    drafts = family.num_draft_layers(body) if family.draft_experts_prefix else 0
    base = body.get("num_hidden_layers")
    if isinstance(drafts, int) and drafts > 0 and isinstance(base, int) and any(k.startswith(f"model.layers.{base}.") for k in headers):
        doc.add(tomlkit.nl())
        doc.add("drafts", tomlkit.aot())
        doc["drafts"].append(tomlkit.item({"name": f"{name}_mtp", "kind": "embedded_mtp", "modes": ["mtp"],
                                           "doc": f"The embedded MTP layers from model.layers.{base}."}))
    return tomlkit.dumps(doc)


def _read_model_config(folder: Path) -> tuple[dict, object]:
    if not folder.is_dir():
        raise DeclarationError(f"{folder}: not a checkpoint folder (not a folder)")
    config = read_config(folder)
    text = config.get("text_config")
    architectures = config.get("architectures")
    if isinstance(text, dict):
        config = text | {"architectures": architectures}
    if architectures is None:
        architectures = []
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise DeclarationError(f"{folder / 'config.json'}: architectures is {kind(architectures)}, where a list of class names belongs")
    family = next((f for a in architectures if (f := family_for_architecture(a))), None)
    if family is None or not family.runtime:
        raise DeclarationError(
            f"{folder}: architecture {', '.join(architectures) or '(none)'} is not supported; "
            f"the runtime builds the families {', '.join(RUNTIME_FAMILIES)}"
        )
    return config, family


def import_checkpoint(folder: Path, name: str | None, out: Path | None) -> tuple[str, str]:
    """Render, validate and (with `out`) write the declaration; returns (text, a summary of layer formats)."""
    name = model_name(folder, name, out)
    config, family = _read_model_config(folder)
    quant, source = read_checkpoint_quant(folder)
    headers = tensor_headers(folder)
    body = config_body(config, family.name)
    text = render_declaration(folder, name, body, family, quant, source, headers)
    with tempfile.TemporaryDirectory() as scratch:
        # Validated exactly as a declaration is, from a scratch file named as the model.
        path = Path(scratch) / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        decl = load_declaration(path, display=f"the declaration of {folder / 'config.json'}")
    if tomllib.loads(text)["config"] != body:
        raise DeclarationError(f"{folder / 'config.json'}: its config does not read back from TOML as written; report this")
    shown = f"the declaration of {folder / 'config.json'}"
    try:
        check_nulls(published_config(config, family.name), body, family.name)
        facts = decl.facts()
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as exc:
        # The loader types the keys it knows; a value of the wrong kind that slips past it is still one message.
        raise DeclarationError(f"{shown}: [config]: a value is not of the kind the {family.name} family reads ({exc}); fix config.json") from None
    by_format: dict[tuple[str, str], list[int]] = {}
    known = set(CHECKPOINT_ALGOS.values()) | {"bf16"}
    for kind_, sites in [("layers", facts.sites)] + [("draft layers", d.sites) for d in facts.drafts]:
        for site in sites:
            if site.format.format not in known:
                raise DeclarationError(
                    f"{folder}: layer {site.layer}'s experts are {site.format.source}, an algorithm moegen does not read; "
                    f"known: {', '.join(CHECKPOINT_ALGOS)}"
                )
            by_format.setdefault((kind_, site.format.format), []).append(site.layer)
    summary = "; ".join(f"{k} {span(tuple(v))}: {fmt}" for (k, fmt), v in by_format.items())
    text += "\n".join(_suggested_target(decl)) + "\n"
    if out is not None:
        from codegen.files import Output, write_verified

        write_verified([Output(out.name, text)], out.parent)
    return text, summary

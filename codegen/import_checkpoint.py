"""`import-checkpoint`: write the declaration of a checkpoint folder (config, quant metadata, drafts).

No torch: safetensors headers are JSON (an 8-byte length, then the header), so the tensor names,
dtypes and shapes are read without loading any data. The declaration it writes has no targets: the
user adds the ones they deploy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from codegen.modelspec import normalize
from registry.declarations import load_declaration
from registry.errors import DeclarationError
from registry.families import RUNTIME_FAMILIES, family_for_architecture
from registry.formats import CheckpointQuant
from registry.model_resolve import span
from registry.quant_meta import read_checkpoint_quant

# config.json keys that describe the file, not the model.
_SKIP_KEYS = {"quantization_config", "torch_dtype", "dtype", "transformers_version", "auto_map", "_name_or_path", "model_type"}

# transformers >= 5 writes some keys under its canonical attribute name where the hub files (and so
# the declarations and registry.families) use the published one: canonical -> published, per family.
_PUBLISHED_NAMES = {"qwen3_moe": {"num_local_experts": "num_experts"}}


def tensor_headers(folder: Path) -> dict[str, dict]:
    """Every tensor's dtype and shape, from the safetensors headers (no tensor data is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DeclarationError(f"{folder}: no *.safetensors files")
    headers: dict[str, dict] = {}
    for path in files:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        headers.update({k: v for k, v in header.items() if k != "__metadata__"})
    return headers


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise DeclarationError(f"cannot write {type(value).__name__} into a declaration")


def render_declaration(folder: Path, name: str) -> str:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if isinstance(config.get("text_config"), dict):
        config = config["text_config"] | {"architectures": config.get("architectures", [])}
    architectures = config.get("architectures") or []
    family = next((f for a in architectures if (f := family_for_architecture(a))), None)
    if family is None or not family.runtime:
        raise DeclarationError(
            f"{folder}: architecture {', '.join(architectures) or '(none)'} is not supported; "
            f"the runtime builds the families {', '.join(RUNTIME_FAMILIES)}"
        )
    quant, source = read_checkpoint_quant(folder)
    headers = tensor_headers(folder)
    body = declaration_config(config, family.name)
    lines = [
        f"# {name}: imported from {folder.name} by `python -m codegen import-checkpoint`.",
        f"# Quant metadata: {_describe_source(source)}; {len(headers)} tensors in the safetensors headers.",
        "",
        "[model]",
        f"name = {json.dumps(name)}",
        f"family = {json.dumps(family.name)}",
        f"doc = {json.dumps(f'Imported from {folder.name}.')}",
        "",
        "[config]",
    ]
    lines += [f"{key} = {_toml_value(value)}" for key, value in body.items()]
    doc = "Unquantized (no quant metadata)." if source == "none" else f"Quant metadata read from {source}."
    lines += ["", "[[checkpoints]]", f"name = {json.dumps(name)}", f"doc = {json.dumps(doc)}"]
    lines += _quant_lines(quant)
    drafts = family.num_draft_layers(config) if family.draft_experts_prefix else 0
    base = config.get("num_hidden_layers", 0)
    if drafts and any(k.startswith(f"model.layers.{base}.") for k in headers):
        lines += ["", "[[drafts]]", f"name = {json.dumps(name + '_mtp')}", 'kind = "embedded_mtp"', 'modes = ["mtp"]',
                  f"doc = {json.dumps(f'The embedded MTP layers from model.layers.{base}.')}"]
    lines += ["", "# No targets yet: add one per deployment, e.g.", "# [[targets]]", f"# checkpoint = {json.dumps(name)}",
              "# sm = 90", '# parallel = "tp1"', '# moe_impls_honored = "*"']
    return "\n".join(lines) + "\n"


def _describe_source(source: str) -> str:
    return "none (unquantized)" if source == "none" else f"read from {source}"


def declaration_config(config: dict, family: str) -> dict:
    """The [config] table: the model's keys under their published names, nulls left out.

    TOML has no null, and a key left out reads as the family default. That is harmless when the build
    comes out the same (Qwen3-MoE's null `sliding_window` next to `use_sliding_window = false`), and a
    silently different model otherwise (a DeepSeek-V3 with `q_lora_rank` null), which is refused.
    """
    renames = _PUBLISHED_NAMES.get(family, {})
    full = {renames.get(k, k): v for k, v in config.items() if renames.get(k, k) not in _SKIP_KEYS}
    body = {k: v for k, v in sorted(full.items()) if v is not None}
    nulls = sorted(set(full) - set(body))
    if nulls:
        meant, built = normalize(family, full), normalize(family, body)
        changed = sorted(k for k in set(meant) | set(built) if meant.get(k) != built.get(k) and k not in nulls)
        changed += [k for k in nulls if k in built and built[k] is not None]
        if changed:
            raise DeclarationError(
                f"config.json sets {', '.join(nulls)} to null; a declaration cannot state null (TOML has none) and "
                f"leaving it out changes what the {family} build inlines ({', '.join(sorted(set(changed)))}): "
                "this checkpoint is not supported"
            )
    return body


def _quant_lines(quant: CheckpointQuant) -> list[str]:
    lines = []
    if quant.quant_algo:
        lines.append(f"quant_algo = {json.dumps(quant.quant_algo)}")
    if quant.exclude_modules:
        lines.append(f"exclude_modules = {_toml_value(list(quant.exclude_modules))}")
    if quant.quantized_layers:
        lines.append("quantized_layers = " + _toml_value(dict(quant.quantized_layers)))
    return lines


def import_checkpoint(folder: Path, name: str | None, out: Path | None) -> tuple[str, str]:
    """Render, validate and (with `out`) write the declaration; returns (text, a summary of layer formats)."""
    if not (folder / "config.json").is_file():
        raise DeclarationError(f"{folder}: not a checkpoint folder (no config.json)")
    # A declaration's model name must equal its file name: `--out DIR/m.toml` names the model `m`.
    name = name or (out.stem if out is not None else folder.name.lower().replace("-", "_").replace(".", "_"))
    text = render_declaration(folder, name)
    # Validate exactly as a declaration is validated, from a scratch file named as the model.
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        decl = load_declaration(path, display=str(out or path.name))
    facts = decl.facts()
    by_format: dict[tuple[str, str], list[int]] = {}
    for kind, sites in [("layers", facts.sites)] + [("draft layers", d.sites) for d in facts.drafts]:
        for site in sites:
            by_format.setdefault((kind, site.format.format), []).append(site.layer)
    summary = "; ".join(f"{kind} {span(tuple(v))}: {fmt}" for (kind, fmt), v in by_format.items())
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return text, summary

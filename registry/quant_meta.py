"""Read a checkpoint's quant metadata files into the form FN1 reads (`CheckpointQuant`).

Real layouts: ModelOpt's `hf_quant_config.json` (one algorithm with `exclude_modules` wildcards, or
`MIXED_PRECISION` with `quantized_layers`), and `config.json`'s `quantization_config` in the
DeepSeek FP8-block form, the gpt-oss `mxfp4` form (`modules_to_not_convert`) and ModelOpt's
converted form (`quant_method: modelopt`, `ignore`). `hf_quant_config.json` wins when both exist,
as in the engines that read these checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from registry.errors import DeclarationError
from registry.formats import CHECKPOINT_ALGOS, MIXED_PRECISION, CheckpointQuant
from registry.inputs import kind, read_json

KNOWN_METHODS = ("fp8 (with weight_block_size)", "mxfp4", "modelopt")
KNOWN_ALGOS = (*CHECKPOINT_ALGOS, MIXED_PRECISION)


def _field(table: dict, key: str, expected: type, source: str, where: str, default=None):
    """`table[key]` when it is of the expected JSON kind (null and absent read as `default`)."""
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, expected):
        wanted = {str: "a string", list: "an array", dict: "an object"}[expected]
        raise DeclarationError(f"{source}: {where}{key} is {kind(value)}, where {wanted} belongs")
    return value


def _names(table: dict, key: str, source: str, where: str) -> tuple[str, ...]:
    """A list of module names or patterns."""
    names = _field(table, key, list, source, where, [])
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise DeclarationError(f"{source}: {where}{key} holds {kind(bad[0])}, where only module names (strings) belong")
    return tuple(names)


def _algo(table: dict, source: str, where: str) -> str | None:
    algo = _field(table, "quant_algo", str, source, where)
    return algo.upper() if algo is not None else None


def _known(algo: str, source: str, where: str) -> str:
    """The global algorithm is refused here when unknown: read on, it would fail much later as a
    format no implementation serves."""
    if algo not in KNOWN_ALGOS:
        raise DeclarationError(f"{source}: {where}quant_algo {algo!r} is not one moegen reads; known: {', '.join(KNOWN_ALGOS)}")
    return algo


def _layers(table: dict, source: str, where: str) -> tuple[tuple[str, str], ...]:
    """`quantized_layers`: module -> {quant_algo}. Entries may name non-expert modules (attention in
    FP8), so their algorithms are checked where the layers' formats are known (import-checkpoint)."""
    layers = _field(table, "quantized_layers", dict, source, where, {})
    entries = []
    for name, entry in layers.items():
        if not isinstance(entry, dict):
            raise DeclarationError(f"{source}: {where}quantized_layers[{name!r}] is {kind(entry)}, where an object belongs")
        entries.append((name, _algo(entry, source, f"{where}quantized_layers[{name!r}].") or ""))
    return tuple(sorted(entries))


def quant_from_hf_quant_config(data: dict, source: str = "hf_quant_config.json") -> CheckpointQuant:
    body = _field(data, "quantization", dict, source, "", data)
    where = "quantization." if "quantization" in data else ""
    algo = _algo(body, source, where)
    if algo is None:
        return CheckpointQuant()
    return CheckpointQuant(_known(algo, source, where), _names(body, "exclude_modules", source, where), _layers(body, source, where))


def quant_from_quantization_config(qc, source: str = "config.json") -> CheckpointQuant:
    if not qc:
        return CheckpointQuant()
    if not isinstance(qc, dict):
        raise DeclarationError(f"{source}: quantization_config is {kind(qc)}, where an object belongs")
    where = "quantization_config."
    method = (_field(qc, "quant_method", str, source, where) or "").lower()
    if method == "fp8":
        if qc.get("weight_block_size") is None:
            raise DeclarationError(
                f"{source}: quantization_config uses per-tensor FP8 (no weight_block_size); the expert formats "
                "moegen knows are FP8 128x128 blocks, MXFP4 and NVFP4"
            )
        block = qc["weight_block_size"]
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise DeclarationError(f"{source}: quantization_config.weight_block_size is {block!r}, where two block edges [rows, columns] belong")
        return CheckpointQuant("FP8_BLOCK_SCALES", _names(qc, "modules_to_not_convert", source, where))
    if method == "mxfp4":
        return CheckpointQuant("MXFP4", _names(qc, "modules_to_not_convert", source, where))
    if method == "modelopt":
        algo = _algo(qc, source, where)
        if not algo:
            # Refused here, naming the field: read on, the missing value would become an algorithm
            # "NONE" that fails much later as an unknown format.
            raise DeclarationError(
                f"{source}: quantization_config (quant_method modelopt) has no quant_algo; "
                "re-export the checkpoint with a ModelOpt that writes it, or provide hf_quant_config.json"
            )
        return CheckpointQuant(_known(algo, source, where), _names(qc, "ignore", source, where), _layers(qc, source, where))
    raise DeclarationError(
        f"{source}: quantization_config quant_method {qc.get('quant_method')!r} is not one moegen reads; "
        f"known: {', '.join(KNOWN_METHODS)}"
    )


def read_checkpoint_quant(folder: Path) -> tuple[CheckpointQuant, str]:
    """The quant metadata of a checkpoint folder and the file it came from."""
    hf = folder / "hf_quant_config.json"
    if hf.exists() or hf.is_symlink():
        return quant_from_hf_quant_config(read_json(hf), str(hf)), hf.name
    config = read_config(folder)
    qc = config.get("quantization_config")
    text = config.get("text_config")
    if qc is None and isinstance(text, dict):
        qc = text.get("quantization_config")
    return quant_from_quantization_config(qc, str(folder / "config.json")), "config.json" if qc else "none"


def read_config(folder: Path) -> dict:
    """A checkpoint folder's config.json, as an object."""
    path = folder / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise DeclarationError(f"{path}: missing; a checkpoint folder has a config.json")
    return read_json(path)

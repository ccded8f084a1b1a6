"""Read a checkpoint's quant metadata files into the form FN1 reads (`CheckpointQuant`).

Real layouts: ModelOpt's `hf_quant_config.json` (one algorithm with `exclude_modules` wildcards, or
`MIXED_PRECISION` with `quantized_layers`), and `config.json`'s `quantization_config` in the
DeepSeek FP8-block form, the gpt-oss `mxfp4` form (`modules_to_not_convert`) and ModelOpt's
converted form (`quant_method: modelopt`, `ignore`). `hf_quant_config.json` wins when both exist,
as in the engines that read these checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from registry.errors import DeclarationError
from registry.formats import CheckpointQuant

KNOWN_METHODS = ("fp8 (with weight_block_size)", "mxfp4", "modelopt")


def quant_from_hf_quant_config(data: dict, source: str = "hf_quant_config.json") -> CheckpointQuant:
    body = data.get("quantization", data)
    algo = body.get("quant_algo")
    if algo is None:
        return CheckpointQuant()
    algo = str(algo).upper()
    layers = body.get("quantized_layers") or {}
    entries = tuple(sorted((name, str(entry.get("quant_algo", "")).upper()) for name, entry in layers.items()))
    return CheckpointQuant(algo, tuple(body.get("exclude_modules") or ()), entries)


def quant_from_quantization_config(qc: dict | None, source: str = "config.json") -> CheckpointQuant:
    if not qc:
        return CheckpointQuant()
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if qc.get("weight_block_size") is None:
            raise DeclarationError(
                f"{source}: quantization_config uses per-tensor FP8 (no weight_block_size); the expert formats "
                "moegen knows are FP8 128x128 blocks, MXFP4 and NVFP4"
            )
        return CheckpointQuant("FP8_BLOCK_SCALES", tuple(qc.get("modules_to_not_convert") or ()))
    if method == "mxfp4":
        return CheckpointQuant("MXFP4", tuple(qc.get("modules_to_not_convert") or ()))
    if method == "modelopt":
        if not qc.get("quant_algo"):
            # Refused here, naming the field: read on, the missing value would become an algorithm
            # "NONE" that fails much later as an unknown format.
            raise DeclarationError(
                f"{source}: quantization_config (quant_method modelopt) has no quant_algo; "
                "re-export the checkpoint with a ModelOpt that writes it, or provide hf_quant_config.json"
            )
        layers = qc.get("quantized_layers") or {}
        entries = tuple(sorted((name, str(entry.get("quant_algo", "")).upper()) for name, entry in layers.items()))
        return CheckpointQuant(str(qc["quant_algo"]).upper(), tuple(qc.get("ignore") or ()), entries)
    raise DeclarationError(
        f"{source}: quantization_config quant_method {qc.get('quant_method')!r} is not one moegen reads; "
        f"known: {', '.join(KNOWN_METHODS)}"
    )


def read_checkpoint_quant(folder: Path) -> tuple[CheckpointQuant, str]:
    """The quant metadata of a checkpoint folder and the file it came from."""
    hf = folder / "hf_quant_config.json"
    if hf.is_file():
        return quant_from_hf_quant_config(_json(hf), str(hf)), hf.name
    config = _json(folder / "config.json")
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return quant_from_quantization_config(qc, str(folder / "config.json")), "config.json" if qc else "none"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DeclarationError(f"{path}: missing; a checkpoint folder has a config.json") from None
    except ValueError as exc:
        raise DeclarationError(f"{path}: not valid JSON: {exc}") from None

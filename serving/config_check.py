"""Refuses a checkpoint folder whose config.json describes another model than the build's, before its weights are read.

Without it a fine-tune with another rope_theta, norm epsilon or expert count loads into the base model's
build without a word and computes another model's logits (or fails later on a tensor shape). What is
compared, and what is not, is registry.checkpoint_config's.
"""

from __future__ import annotations

from pathlib import Path

from runtime.checkpoint.errors import CheckpointConfigError
from runtime.checkpoint.reader import CONFIG_FILE, read_json


def check_config(facts_module, folder, total: int, num_layers=None) -> None:
    """CheckpointConfigError unless `folder`'s config.json gives the model of `facts_module` (a generated
    facts module: its FAMILY and CONFIG) in the decoder layers a build of `total` layers keeps under
    `num_layers` (None: all); a folder without config.json has nothing to compare (the loader reads its
    tensors alone)."""
    from registry.checkpoint_config import differences
    from runtime.causal_lm import check_num_layers

    try:
        layers = total if num_layers is None else check_num_layers(num_layers, total, facts_module.MODEL)
    except (TypeError, ValueError):
        layers = total   # a count out of range is the build's own refusal, raised when it is constructed
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return
    model = facts_module.MODEL
    advice = (f"declare a model for this checkpoint (python -m codegen import-checkpoint {folder} --name NAME) and "
              "generate its builds")
    given = read_json(path)
    try:
        found = differences(facts_module.FAMILY, facts_module.CONFIG, given, layers)
    except ValueError as exc:
        raise CheckpointConfigError(f"{path} is not a {facts_module.FAMILY} config like {model}'s: {exc}; {advice}") from None
    if found:
        said = "; ".join(f"{what} is {theirs!r} in the checkpoint, {ours!r} in the build" for what, theirs, ours in found)
        raise CheckpointConfigError(f"{path} describes another model than the one {model}'s builds were generated from: "
                                    f"{said}. Loaded, it would compute another model's logits: {advice}")

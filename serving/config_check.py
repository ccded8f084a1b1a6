"""Refuses a checkpoint folder whose config.json describes another model than the build's, before its weights are read.

Without it a fine-tune with another rope_theta, norm epsilon or expert count loads into the base model's
build without a word and computes another model's logits (or fails later on a tensor shape). The target's
folder is compared with the model's config, an external drafter's own folder with the drafter's declared config.
What is compared, and what is not, is registry.checkpoint_config's.
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
    from runtime.causal_lm import check_num_layers

    model = facts_module.MODEL
    try:
        layers = total if num_layers is None else check_num_layers(num_layers, total, model)
    except (TypeError, ValueError):
        layers = total   # a count out of range is the build's own refusal, raised when it is constructed
    advice = (f"declare a model for this checkpoint (python -m codegen import-checkpoint {folder} --name NAME) and "
              "generate its builds")
    _compare(folder, facts_module.FAMILY, facts_module.CONFIG, layers,
             like=f"{model}'s", than=f"the one {model}'s builds were generated from", advice=advice)


def check_draft_config(facts_module, draft: str, folder) -> None:
    """CheckpointConfigError unless `folder`'s config.json gives the draft `draft` of `facts_module`'s model as
    declared (its DRAFT_CONFIGS entry, read as a config of its DRAFT_FAMILIES entry) in all its decoder layers.
    Only an external drafter's DRAFT_FAMILIES entry names a family: an Eagle3 head's config is no family's and MTP
    heads and draft stages have no config of their own (their entry is None), so their folders are not compared. A
    folder without config.json has nothing to compare."""
    family = facts_module.DRAFT_FAMILIES[draft]
    if family is None:
        return
    config, model = facts_module.DRAFT_CONFIGS[draft], facts_module.MODEL
    subject = f"the draft {draft} of {model}"
    advice = ("pass a checkpoint of the declared drafter (draft_checkpoint=DIR, --draft-checkpoint DIR), or declare this "
              f"folder's config as the config of {model}'s [[drafts]] entry {draft} and generate its builds")
    # A draft builds every decoder layer its config declares.
    _compare(folder, family, config, config["num_hidden_layers"], like=subject, than=subject, advice=advice)


def _compare(folder, family: str, built: dict, layers: int, *, like: str, than: str, advice: str) -> None:
    """CheckpointConfigError unless `folder`'s config.json, if it has one, is the `family` config `built` over the
    first `layers` decoder layers; its errors name the build's config as `like` ("not a config like ...") and
    `than` ("another model than ..."), then give `advice`."""
    from registry.checkpoint_config import differences

    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return
    given = read_json(path)
    try:
        found = differences(family, built, given, layers)
    except ValueError as exc:
        raise CheckpointConfigError(f"{path} is not a {family} config like {like}: {exc}; {advice}") from None
    if found:
        said = "; ".join(f"{what} is {theirs!r} in the checkpoint, {ours!r} in the build" for what, theirs, ours in found)
        raise CheckpointConfigError(f"{path} describes another model than {than}: "
                                    f"{said}. Loaded, it would compute another model's logits: {advice}")

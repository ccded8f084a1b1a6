"""Where a checkpoint's config.json and the config a build was generated from disagree about the model the build computes (pure Python: read at load, without pydantic).

A fine-tune with another rope_theta or expert count would otherwise load into the base model's build and
compute another model's logits. Raw keys are not compared: transformers writes defaults and respellings a
declaration leaves out, which build the same model. Both configs are normalized as the family's template
reads them (registry.normal_config), and compared over the values a build reads, in the decoder layers it
keeps (`num_layers` builds and their checkpoints hold fewer than the model).
"""

from __future__ import annotations

import math

from families import FAMILIES
from registry.normal_config import normalize, unbounded_limit

# config.json keys that describe the file, not the model.
SKIP_KEYS = {"quantization_config", "torch_dtype", "dtype", "transformers_version", "auto_map", "_name_or_path", "model_type"}

# Normalized values named by the config keys they were resolved from.
_DERIVED = {"sliding_windows": "the sliding window of each layer (config.sliding_window, config.layer_types)",
            "attention_layers": "the full-attention layers (config.layer_types)"}
_ROPE = {"base": "config.rope_theta", "scaling": "config.rope_scaling.rope_type",
         "rotary_dim": "the rotary dims (config.head_dim x config.partial_rotary_factor)"}


def published_config(config: dict, family: str) -> dict:
    """config.json's model keys under their published names (nulls kept)."""
    # transformers >= 5 writes some keys under its canonical name (the family's spec.published_names).
    renames = FAMILIES[family].published_names
    config = FAMILIES[family].published_form(config)
    return {renames.get(k, k): v for k, v in config.items() if renames.get(k, k) not in SKIP_KEYS}


def differences(family: str, built: dict, checkpoint: dict, layers: int) -> list[tuple[str, object, object]]:
    """(what differs, named by its config path; the checkpoint's value; the build's value) for each value the
    build reads that `checkpoint` (a config.json) gives otherwise, over the first `layers` decoder layers;
    `built` is the build's typed config (a generated facts module's CONFIG). A ValueError when config.json
    cannot be read as the family's config at all."""
    spec = FAMILIES[family]
    given = published_config(checkpoint, family)
    lacking = [k for k, key in spec.keys.items() if key.kind in ("required", "template") and given.get(k) is None]
    if lacking:
        raise ValueError(f"it lacks {', '.join(lacking)}, which every {family} config states")
    ours = normalize(family, built)
    try:
        theirs = normalize(family, {k: v for k, v in given.items() if k in spec.keys})
    except (TypeError, KeyError, ValueError, ZeroDivisionError) as exc:
        # Not typed as a declaration is (no pydantic on the serving host): a value of the wrong kind ends here.
        raise ValueError(f"its values cannot be read as a {family} config ({type(exc).__name__}: {exc})") from None
    # A checkpoint may hold more decoder layers than a num_layers build keeps, never another model's count;
    # fewer than it keeps is the loader's refusal, which counts the layers the tensors hold.
    kept = min(layers, theirs["num_hidden_layers"])
    found = []
    if theirs["num_hidden_layers"] > ours["num_hidden_layers"]:
        found.append(("config.num_hidden_layers", theirs["num_hidden_layers"], ours["num_hidden_layers"]))
    for key in sorted(set(ours) | set(theirs)):
        if key == "num_hidden_layers" or key in spec.keys and not _read(spec, key, ours, kept):
            continue
        mine, other = _in_layers(spec, key, ours.get(key), kept), _in_layers(spec, key, theirs.get(key), kept)
        if key == "rope":
            found += [(_ROPE.get(k, f"config.rope_scaling.{k}"), other.get(k), mine.get(k))
                      for k in sorted(set(mine) | set(other)) if mine.get(k) != other.get(k)]
        elif _comparable(mine) != _comparable(other):
            found.append((_DERIVED.get(key, f"config.{key}"), _comparable(other), _comparable(mine)))
    return found


def _read(spec, key: str, c: dict, kept: int) -> bool:
    """Whether a build of config `c` reads `key` in its first `kept` layers."""
    if not spec.keys[key].built:
        return False
    if key == "head_dim":
        # A family whose head_dim hook reads other keys (MLA: qk_rope_head_dim) never reads this one.
        return spec.stores_head_dim
    if key == "intermediate_size" and spec.intermediate_key != key:
        # The dense layers' MLP: none to build where every kept layer is an MoE layer.
        return set(range(kept)) - set(spec.moe_layers(c)) != set()
    return True


def _in_layers(spec, key: str, value, kept: int):
    """`value` as far as the first `kept` decoder layers go, for a value given per layer or as layer indices."""
    kind = spec.keys[key].type if key in spec.keys else None
    if key == "sliding_windows" or kind in ("layer_pattern", "layer_types", "mixer_types"):
        return value if value is None else value[:kept]
    if key == "attention_layers" or kind == "indices":
        return [i for i in value or () if i < kept]   # transformers reads a null list of layers as none
    if kind == "index":
        return min(value, kept)
    if kind == "unbounded_limit" and (value is None or unbounded_limit(value)):
        return [0, math.inf]   # absent and [0, inf] alike leave Mamba-2's step unbounded, as the build runs it
    return value


def _comparable(value):
    """Lists and tuples alike (a declaration's normalized windows are a tuple, a JSON list elsewhere)."""
    return list(value) if isinstance(value, tuple) else value

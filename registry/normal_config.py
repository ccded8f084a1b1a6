"""A family's typed HF-style config, normalized into the constants its template inlines (pure Python: the load path compares a checkpoint's config.json with it on a host without pydantic).

Declarations hold config.json keys as checkpoints publish them: hub files use `rope_theta` /
`rope_scaling` and leave out keys that equal the library default, while transformers >= 5 writes
`rope_parameters`. This fills each family's defaults and resolves the rotary parameters the way
transformers does, so templates read one flat dict. tests/generated/test_modelspec.py checks every
value here against the transformers config class built from the same keys (the oracle for what the
checkpoint means), and every default below against that class's own default. Typing the config first
(pydantic) is the caller's part: codegen.modelspec for declarations.
"""

from __future__ import annotations

from typing import Any

from families import FAMILIES, RUNTIME_FAMILIES


def defaults(family: str) -> dict:
    """The transformers default of each optional key the family's code reads (stated once, in its spec)."""
    return {k: key.value for k, key in FAMILIES[family].keys.items() if key.kind == "default"}


# Each family's config-class defaults (transformers 5.x) for the keys its template reads, stated
# once with each key's type (families/<family>/spec.py).
DEFAULTS: dict[str, dict[str, Any]] = {family: defaults(family) for family in RUNTIME_FAMILIES}

# Raw keys that `normalize` folds into derived values (`rope`, `head_dim`, `sliding_windows`) and then
# drops, so a template can only read the resolved value and two configs that mean the same build
# normalize equal (import-checkpoint relies on that to tell a harmless null from a meaningful one).
_FOLDED = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor", "rotary_dim", "sliding_window",
           "use_sliding_window", "layer_types", "full_attention_interval")


def rope_parameters(config: dict, defaults: dict, rotary_factor=None) -> dict:
    """The one rope dict transformers builds from a config, with its precedence: `rope_scaling` over
    `rope_parameters` over the class `defaults`; inside it, its own `rope_theta`/`partial_rotary_factor`
    over the top-level keys (a family's legacy spelling of the factor, `rotary_factor`, counts as top-level)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or defaults.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.setdefault("rope_theta", config.get("rope_theta", defaults.get("rope_theta")))
    factor = config.get("partial_rotary_factor", defaults.get("partial_rotary_factor"))
    if factor is None and rotary_factor is not None:
        factor = rotary_factor(config, defaults)
    if factor is not None:
        params.setdefault("partial_rotary_factor", factor)
    return params


def rope(config: dict, defaults: dict, head_dim: int, rotary_factor=None, owner: str = "config") -> dict:
    """Rotary constants: kind, base, rotary dim and the scaling parameters (yarn / llama3); `head_dim` is
    the dimension rotary turns per head (a family's `spec.head_dim`)."""
    params = rope_parameters(config, defaults, rotary_factor)
    if params["rope_theta"] is None:
        # A family without rotary (Nemotron-H: no rope key, none in its config class): nothing rotates.
        return {"scaling": "none", "base": None, "rotary_dim": 0}
    kind = params["rope_type"]
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    out = {"scaling": kind, "base": float(params["rope_theta"]), "rotary_dim": rotary_dim}
    if kind == "yarn":
        out |= {
            "factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            # transformers reads `or` here: an explicit null or 0 also means the paper's value.
            "beta_fast": float(params.get("beta_fast") or 32.0),
            "beta_slow": float(params.get("beta_slow") or 1.0),
            "truncate": bool(params.get("truncate", True)),
        }
        # Optional YaRN magnitude terms: absent means the paper's attention factor (runtime/ops/rotary.py).
        out |= {k: params[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k) is not None}
    elif kind == "llama3":
        out |= {k: params[k] for k in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
    elif kind != "default":
        raise ValueError(f"{owner}: rope type {kind!r} is not one the runtime builds (default, yarn, llama3)")
    return out


def unbounded_limit(limit) -> bool:
    """Whether a Mamba-2 `time_step_limit` bounds nothing, as the builds run it: `[0, inf]`, inf spelled as a float
    (TOML `inf`, JSON's Infinity) or as transformers 5 saves it (`{"__float__": "Infinity"}`)."""
    return (isinstance(limit, list) and len(limit) == 2 and type(limit[0]) in (int, float) and limit[0] == 0
            and limit[1] in (float("inf"), {"__float__": "Infinity"}))


def normalize(family: str, config: dict) -> dict:
    """Defaults filled in, head_dim and rotary parameters resolved, one attention window per layer, from a
    `config` already typed (`registry.configs.validate_config`): nothing here checks a value's type or range."""
    spec = FAMILIES[family]
    c = DEFAULTS[family] | dict(config)
    head_dim = spec.head_dim(c)
    if spec.stores_head_dim:
        c["head_dim"] = head_dim
    c["rope"] = rope(config, DEFAULTS[family], head_dim, spec.rotary_factor, family)
    c["sliding_windows"] = spec.sliding_windows(c)
    attention_layers = spec.attention_layers(c)
    if attention_layers is not None:
        c["attention_layers"] = attention_layers
    for key in _FOLDED:
        c.pop(key, None)
    return c

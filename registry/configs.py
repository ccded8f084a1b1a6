"""Each family's `[config]` keys, typed and range-checked when a declaration loads: pydantic models built from the keys each `families/<family>/spec.py` states.

A declaration's `[config]` holds config.json keys as checkpoints publish them. Every key moegen or a
family template reads is stated once, in its family's spec, with its type and kind (`families.base.Key`):
integers are ints (never bools, strings or floats), dimensions positive, floats finite, rotary types and
activations the runtime builds, per-layer lists of the model's length. Other keys (HF configs carry
many) are accepted and dropped: only the typed keys reach `Declaration.config` and so generated code.
`None` is a value only where transformers accepts null for the key (config.json has nulls; TOML has none).

Kinds of key: `required` the selection rules need it; `template` only a family template reads it, and
`codegen.modelspec.normalize` refuses a render without it; `default` transformers' config-class default,
which `registry.normal_config.normalize` fills in (tests/generated/test_modelspec.py checks each against the class); `optional`
defaults to `None`: absent.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from families import FAMILIES
from families.base import ConfigError, FamilySpec, Key
from registry.normal_config import unbounded_limit

# Bounds that keep a generation finite (one table row per layer) and a tensor dimension an int32.
MAX_LAYERS = 1024
MAX_DRAFT_LAYERS = 64
MAX_DIM = 2**31 - 1

Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
Layers = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
Count = Annotated[int, Field(ge=0, le=MAX_DRAFT_LAYERS)]
Index = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Eps = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]
Identifier = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=100)]
RopeType = Literal["default", "yarn", "llama3"]   # what runtime.ops.RotaryEmbedding builds
LayerType = Literal["sliding_attention", "full_attention"]
MixerType = Literal["linear_attention", "full_attention"]   # a hybrid model's token mixer per layer (Qwen3-Next)


class _Typed(BaseModel):
    # strict: 4.0, "4" and true are not the integer 4; unknown keys are dropped (see the module docstring).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class RopeScaling(_Typed):
    """`rope_scaling` (hub files) or `rope_parameters` (transformers >= 5): a type the runtime builds and its numbers."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    rope_type: RopeType | None = None
    type: RopeType | None = None                      # the legacy spelling of rope_type
    rope_theta: Positive | None = None
    partial_rotary_factor: Fraction | None = None
    factor: Positive | None = None
    original_max_position_embeddings: Dim | None = None
    beta_fast: NonNegative | None = None              # transformers reads `or 32.0`: 0 and null mean the paper's value
    beta_slow: NonNegative | None = None
    truncate: bool | None = None
    mscale: NonNegative | None = None
    mscale_all_dim: NonNegative | None = None
    attention_factor: Positive | None = None
    low_freq_factor: Positive | None = None
    high_freq_factor: Positive | None = None

    @model_validator(mode="after")
    def _complete(self):
        kind = self.rope_type or self.type or "default"
        needs = {"yarn": ("factor", "original_max_position_embeddings"),
                 "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}.get(kind, ())
        lacking = [k for k in needs if getattr(self, k) is None]
        if lacking:
            raise ConfigError((), f"rope type {kind!r} needs {', '.join(lacking)}; add it")
        return self


class Eagle3Config(_Typed):
    """An Eagle3 head's config besides the shape keys the declaration checks one by one (registry.declaration_model
    EAGLE3_KEYS, the aux layer ids): a Llama decoder layer as published Eagle3 heads are, typed. A value the head
    does not build (another activation, biases, more than one layer) is refused, not dropped."""

    num_hidden_layers: Literal[1] | None = None
    hidden_act: Literal["silu"] | None = None
    attention_bias: Literal[False] | None = None
    mlp_bias: Literal[False] | None = None
    tie_word_embeddings: Literal[False] | None = None   # its lm_head maps onto the draft vocabulary, not the embedding's
    rms_norm_eps: Eps | None = None
    rope_theta: Positive | None = None
    rope_scaling: RopeScaling | None = None
    rope_parameters: RopeScaling | None = None
    partial_rotary_factor: Fraction | None = None
    max_position_embeddings: Dim | None = None


def validate_eagle3(config: dict, checked: tuple[str, ...]) -> dict:
    """An Eagle3 config with the keys of `checked` as given (the declaration checks them with messages of
    their own) and the rest typed (unknown keys dropped), or `ConfigError` for the first bad one."""
    try:
        typed = Eagle3Config.model_validate({k: v for k, v in config.items() if k not in checked})
    except ValidationError as exc:
        raise _first_error("eagle3", exc) from None
    return {k: config[k] for k in checked if k in config} | typed.model_dump(exclude_unset=True)


def _unbounded(limit: list) -> list:
    """A Mamba-2 `time_step_limit` that bounds nothing: `[0, inf]` (config.json writes inf as transformers 5
    saves it, `{"__float__": "Infinity"}`; TOML as `inf`). The runtime's scan runs dt unbounded, as vLLM
    does and as transformers' decode step does whatever the config says, so a real bound is refused."""
    if unbounded_limit(limit):
        return limit
    text = repr(limit)
    raise ConfigError((), f"time_step_limit {text if len(text) <= 40 else text[:37] + '...'} bounds Mamba-2's step "
                          "dt; moegen's scan runs it unbounded, (0, inf), as vLLM runs these checkpoints: set "
                          "[0.0, inf] or remove the key")


# Nemotron-H's layer letters: Mamba, attention, MoE, MLP.
_PATTERN = Annotated[str, Field(pattern=r"^[M*E-]+$", max_length=MAX_LAYERS)]

# What each `families.base.Key` type name means (a spec names a type; pydantic checks it here).
TYPES = {
    "dim": Dim, "layers": Layers, "count": Count, "index": Index, "positive": Positive, "non_negative": NonNegative,
    "fraction": Fraction, "eps": Eps, "bool": bool, "identifiers": list[Identifier], "indices": list[Index],
    "rope": RopeScaling, "layer_types": list[LayerType], "mixer_types": list[MixerType],
    "layer_pattern": _PATTERN,   # one letter per decoder layer
    "draft_pattern": _PATTERN,   # one letter per MTP layer (a type of its own: not cut with the decoder layers)
    "unbounded_limit": Annotated[list, AfterValidator(_unbounded)],
}


class _FamilyConfig(_Typed):
    """A family's typed `[config]`: the checks every family shares, then the family's own (`spec.check`)."""

    spec: ClassVar[FamilySpec]

    @model_validator(mode="after")
    def _consistent(self):
        spec = self.spec
        experts = getattr(self, spec.experts_key)
        if self.num_experts_per_tok > experts:
            raise ConfigError(("num_experts_per_tok",), f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                   f"{experts} routed experts; a token picks at most every expert")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ConfigError(("num_key_value_heads",), f"num_key_value_heads {kv} must divide num_attention_heads {heads}")
        for key in ("head_dim", "qk_rope_head_dim", "rotary_dim"):
            value = getattr(self, key, None)
            if value is not None and value % 2:
                raise ConfigError((key,), f"{key} {value} must be even: rotary embedding turns pairs of dimensions")
        spec.check({k: getattr(self, k) for k in type(self).model_fields})
        return self


def _field(key: Key):
    kind = Literal[key.type] if isinstance(key.type, tuple) else TYPES[key.type]
    annotation = kind | None if key.nullable else kind
    if key.kind == "required":
        return annotation, Field()
    return annotation, Field(default=key.value if key.kind == "default" else None)


def _config_model(spec: FamilySpec) -> type[_FamilyConfig]:
    fields = {name: _field(key) for name, key in spec.keys.items()}
    model = create_model(f"{spec.name}_config", __base__=_FamilyConfig, **fields)
    model.spec = spec
    return model


# One typed model per family, built from its spec's keys (their types and defaults are stated there only).
CONFIGS: dict[str, type[_FamilyConfig]] = {name: _config_model(spec) for name, spec in FAMILIES.items()}


def template_keys(family: str) -> tuple[str, ...]:
    return tuple(k for k, key in FAMILIES[family].keys.items() if key.kind == "template")


def required_keys(family: str) -> tuple[str, ...]:
    return tuple(k for k, key in FAMILIES[family].keys.items() if key.kind == "required")


def validate_config(family: str, config: dict) -> dict:
    """The typed keys of `config` as given (unknown keys dropped), or `ConfigError` for the first bad one."""
    try:
        typed = CONFIGS[family].model_validate(config)
    except ValidationError as exc:
        raise _first_error(family, exc) from None
    return typed.model_dump(exclude_unset=True)


def _first_error(family: str, exc: ValidationError) -> ConfigError:
    errors = exc.errors()
    missing = [e["loc"][0] for e in errors if e["type"] == "missing" and len(e["loc"]) == 1]
    if missing:
        return ConfigError((), f"lacks {', '.join(missing)}, which family {family} needs; add it")
    first = errors[0]
    original = first.get("ctx", {}).get("error")
    loc = tuple(first["loc"])
    if isinstance(original, ConfigError):
        return ConfigError(loc + original.key, str(original))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message += "; remove it or fix its spelling"
    elif first["type"].endswith("_type") or first["type"] in ("literal_error", "string_pattern_mismatch"):
        message += f", not {_shown(first['input'])}"
    return ConfigError(loc, message)


def _shown(value) -> str:
    """A value for a one-line message: its kind, and (short) the value itself."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
    kind = kinds.get(type(value), type(value).__name__)
    if isinstance(value, (list, dict)):
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"

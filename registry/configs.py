"""Each family's `[config]` keys: typed and range-checked when a declaration loads, with the transformers default of each optional key.

A declaration's `[config]` holds config.json keys as checkpoints publish them. Every key moegen or a
family template reads is declared here, once: integers are ints (never bools, strings or floats),
dimensions positive, floats finite, rotary types and activations the runtime builds, per-layer lists
of the model's length. Other keys (HF configs carry many) are accepted and dropped: only the typed
keys reach `Declaration.config` and so generated code. `None` is a value only where transformers
accepts null for the key (config.json has nulls; TOML has none).

Three kinds of key: `Field(...)` the selection rules need it; `template()` only a family template
reads it, and `codegen.modelspec.normalize` refuses a render without it; `default(v)` transformers'
config-class default, which `normalize` fills in (tests/generated/test_modelspec.py checks each
against the class). Anything else defaults to `None`: absent.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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

_TEMPLATE = {"template": True}
_DEFAULT = {"default": True}


def template(kind_default=None):
    """A key only the family template reads (no default moegen may assume)."""
    return Field(default=kind_default, json_schema_extra=_TEMPLATE)


def default(value):
    """Transformers' config-class default for the key (the one place it is stated)."""
    return Field(default=value, json_schema_extra=_DEFAULT)


class ConfigError(ValueError):
    """A `[config]` value refused: `key` is its path inside the table, the message says what to change."""

    def __init__(self, key: tuple, message: str):
        super().__init__(message)
        self.key = key


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


class _Base(_Typed):
    """Keys of every family; the first four are what every MoE layer's shape is read from."""

    vocab_size: Dim
    hidden_size: Dim
    num_hidden_layers: Layers
    num_experts_per_tok: Dim
    architectures: list[Identifier] | None = None
    max_position_embeddings: Dim | None = None
    num_attention_heads: Dim | None = template()
    num_key_value_heads: Dim | None = None
    head_dim: Dim | None = None
    rope_theta: Positive | None = None
    rope_scaling: RopeScaling | None = None
    rope_parameters: RopeScaling | None = None
    partial_rotary_factor: Fraction | None = None

    def experts(self) -> int:
        raise NotImplementedError

    @model_validator(mode="after")
    def _consistent(self):
        if self.num_experts_per_tok > self.experts():
            raise ConfigError(("num_experts_per_tok",), f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                   f"{self.experts()} routed experts; a token picks at most every expert")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ConfigError(("num_key_value_heads",), f"num_key_value_heads {kv} must divide num_attention_heads {heads}")
        for key in ("head_dim", "qk_rope_head_dim", "rotary_dim"):
            value = getattr(self, key, None)
            if value is not None and value % 2:
                raise ConfigError((key,), f"{key} {value} must be even: rotary embedding turns pairs of dimensions")
        self._check()
        return self

    def _check(self) -> None:
        """Family-specific checks across keys."""

    def _layer_list(self, key: str, values) -> None:
        if values is None:
            return
        bad = [v for v in values if v >= self.num_hidden_layers]
        if bad or len(set(values)) != len(values):
            raise ConfigError((key,), f"{key} must list distinct layer indices below num_hidden_layers "
                                   f"{self.num_hidden_layers}; got {values!r}"[:300])

    def _per_layer(self, key: str, values) -> None:
        if values is not None and len(values) != self.num_hidden_layers:
            raise ConfigError((key,), f"{key} has {len(values)} entries; it needs one per layer (num_hidden_layers "
                                   f"{self.num_hidden_layers})")


class _Runtime(_Base):
    """Keys of the families the runtime builds."""

    hidden_act: Literal["silu"] = default("silu")
    tie_word_embeddings: Literal[False] = default(False)   # the builds load lm_head.weight on its own


class _DeepseekMoe(_Runtime):
    """DeepSeek-V3's MoE layout (GLM-4 MoE keeps it): dense layers first, sigmoid group-limited routing."""

    moe_intermediate_size: Dim
    n_routed_experts: Dim
    first_k_dense_replace: Index
    intermediate_size: Dim | None = template()
    moe_layer_freq: Dim | None = None
    num_nextn_predict_layers: Count | None = None
    n_shared_experts: Dim = default(1)
    norm_topk_prob: bool = default(True)
    attention_bias: bool = default(False)

    def experts(self) -> int:
        return self.n_routed_experts

    def _check(self) -> None:
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(("first_k_dense_replace",), f"first_k_dense_replace {self.first_k_dense_replace} exceeds "
                                   f"num_hidden_layers {self.num_hidden_layers}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(("n_group",), f"n_group {self.n_group} must divide n_routed_experts {self.n_routed_experts}")
        if self.topk_group > self.n_group:
            raise ConfigError(("topk_group",), f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ConfigError(("num_experts_per_tok",), f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                                   f"{reachable} experts of the topk_group {self.topk_group} groups a token may pick from")


class DeepseekV3Config(_DeepseekMoe):
    q_lora_rank: Dim | None = default(1536)        # null: queries straight from the hidden state (V2-Lite style)
    kv_lora_rank: Dim | None = template()
    qk_nope_head_dim: Dim | None = template()
    qk_rope_head_dim: Dim | None = template()
    v_head_dim: Dim | None = template()
    n_group: Dim = default(8)
    topk_group: Dim = default(4)
    routed_scaling_factor: Positive = default(2.5)
    rms_norm_eps: Eps = default(1e-6)
    rope_theta: Positive = default(10000.0)
    rope_interleave: bool = default(True)


class Glm4MoeConfig(_DeepseekMoe):
    num_key_value_heads: Dim = default(8)
    partial_rotary_factor: Fraction = default(0.5)
    use_qk_norm: bool = default(False)
    n_group: Dim = default(1)
    topk_group: Dim = default(1)
    routed_scaling_factor: Positive = default(1.0)
    rms_norm_eps: Eps = default(1e-5)
    rope_theta: Positive = default(10000.0)


class _SparseStep(_Base):
    """Qwen's layout: every `decoder_sparse_step`-th layer is MoE, except those `mlp_only_layers` names."""

    moe_intermediate_size: Dim
    num_experts: Dim
    intermediate_size: Dim | None = None            # the dense layers' MLP, when there are any
    decoder_sparse_step: Dim | None = None
    mlp_only_layers: list[Index] | None = None

    def experts(self) -> int:
        return self.num_experts

    def _check(self) -> None:
        self._layer_list("mlp_only_layers", self.mlp_only_layers)


class Qwen3MoeConfig(_SparseStep, _Runtime):
    decoder_sparse_step: Dim = default(1)
    mlp_only_layers: list[Index] | None = default([])   # null: none (transformers reads null as [])
    # The class default window applies only under use_sliding_window (off by default).
    sliding_window: Dim | None = default(4096)
    use_sliding_window: bool = default(False)
    norm_topk_prob: bool = default(False)
    attention_bias: bool = default(False)
    num_key_value_heads: Dim = default(4)
    rms_norm_eps: Eps = default(1e-6)
    rope_theta: Positive = default(10000.0)


class _LocalExperts(_Runtime):
    intermediate_size: Dim
    num_local_experts: Dim

    def experts(self) -> int:
        return self.num_local_experts


class MixtralConfig(_LocalExperts):
    head_dim: Dim | None = default(None)            # null: hidden_size // num_attention_heads
    sliding_window: Dim | None = default(None)
    num_key_value_heads: Dim = default(8)
    rms_norm_eps: Eps = default(1e-5)
    rope_theta: Positive = default(1000000.0)


class GptOssConfig(_LocalExperts):
    head_dim: Dim = default(64)
    attention_bias: bool = default(True)
    sliding_window: Dim = default(128)
    layer_types: list[LayerType] | None = None      # absent: sliding and full attention alternate
    swiglu_limit: Positive = default(7.0)
    num_key_value_heads: Dim = default(8)
    rms_norm_eps: Eps = default(1e-5)
    rope_theta: Positive = default(150000.0)
    rope_scaling: RopeScaling | None = default(dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                    original_max_position_embeddings=4096))

    def _check(self) -> None:
        self._per_layer("layer_types", self.layer_types)


class MinimaxM2Config(_LocalExperts):
    head_dim: Dim = default(128)
    rotary_dim: Dim | None = None                    # legacy spelling of a partial rotary factor
    use_qk_norm: bool | None = None
    num_mtp_modules: Count | None = None
    num_key_value_heads: Dim = default(8)
    rms_norm_eps: Eps = default(1e-6)
    rope_theta: Positive = default(5000000.0)

    def _check(self) -> None:
        if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            raise ConfigError(("rotary_dim",), f"rotary_dim {self.rotary_dim} exceeds head_dim {self.head_dim}")


class Qwen3NextConfig(_SparseStep):
    mtp_num_hidden_layers: Count | None = None
    shared_expert_intermediate_size: Dim | None = None


class NemotronHConfig(_Base):
    moe_intermediate_size: Dim
    n_routed_experts: Dim
    # One letter per layer: M Mamba, * attention, - MLP, E MoE.
    hybrid_override_pattern: Annotated[str, Field(pattern=r"^[M*E-]+$", max_length=MAX_LAYERS)]
    moe_shared_expert_intermediate_size: Dim | None = None
    num_nextn_predict_layers: Count | None = None
    mlp_hidden_act: Literal["relu2"] | None = None

    def experts(self) -> int:
        return self.n_routed_experts

    def _check(self) -> None:
        self._per_layer("hybrid_override_pattern", self.hybrid_override_pattern)


CONFIGS: dict[str, type[_Base]] = {
    "deepseek_v3": DeepseekV3Config,
    "glm4_moe": Glm4MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "gpt_oss": GptOssConfig,
    "minimax_m2": MinimaxM2Config,
    "qwen3_next": Qwen3NextConfig,
    "nemotron_h": NemotronHConfig,
}


def _marked(family: str, mark: dict) -> list[str]:
    return [k for k, f in CONFIGS[family].model_fields.items() if f.json_schema_extra == mark]


def defaults(family: str) -> dict:
    """The transformers default of each optional key the family's code reads."""
    fields = CONFIGS[family].model_fields
    return {k: fields[k].default for k in _marked(family, _DEFAULT)}


def template_keys(family: str) -> tuple[str, ...]:
    return tuple(_marked(family, _TEMPLATE))


def required_keys(family: str) -> tuple[str, ...]:
    return tuple(k for k, f in CONFIGS[family].model_fields.items() if f.is_required())


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

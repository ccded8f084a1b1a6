"""What a family's `spec.py` is made of: its config keys, its MoE layers and shape, and the hooks codegen calls.

Plain data and small pure functions of a declaration's HF-style `config` (stdlib only: registry builds
its typed pydantic models from `FamilySpec.keys`, codegen reads the rest). Every function here reads
a config `registry.configs` already typed and range-checked; a family states each fact once and a
child family (glm4_moe of deepseek_v3, mixtral of qwen3_moe) is its parent's spec with fields replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from contract import MoeShape

Config = dict[str, Any]


class ConfigError(ValueError):
    """A `[config]` value refused: `key` is its path inside the table, the message says what to change."""

    def __init__(self, key: tuple, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Key:
    """One `[config]` key a family reads. `type` names a type of `registry.configs.TYPES`, or is a tuple
    of the only values the runtime builds. `kind`: `required` (the selection rules need it), `template`
    (only the family template reads it: a render refuses its absence), `default` (transformers'
    config-class default, `value`, filled in by codegen), `optional` (absent means None). `built`: False for
    a key typed and kept but read by no build, which a checkpoint may therefore set otherwise (its context
    length, the architecture names it lists): loading does not compare it (registry.checkpoint_config)."""

    type: str | tuple
    kind: str = "optional"
    value: Any = None
    nullable: bool = True   # None is a value (config.json has nulls where transformers accepts them)
    built: bool = True


def required(type_: str | tuple) -> Key:
    return Key(type_, "required", nullable=False)


def template(type_: str | tuple) -> Key:
    return Key(type_, "template")


def default(type_: str | tuple, value: Any, nullable: bool = False) -> Key:
    return Key(type_, "default", value, nullable)


def optional(type_: str | tuple) -> Key:
    return Key(type_, "optional")


def unbuilt(type_: str | tuple) -> Key:
    """An optional key no build reads."""
    return Key(type_, "optional", built=False)


# Keys of every family; the four required ones are what every MoE layer's shape is read from.
BASE_KEYS: dict[str, Key] = {
    "vocab_size": required("dim"),
    "hidden_size": required("dim"),
    "num_hidden_layers": required("layers"),
    "num_experts_per_tok": required("dim"),
    "architectures": unbuilt("identifiers"),
    "max_position_embeddings": unbuilt("dim"),    # rotary tables grow with the cache; yarn reads its own original length
    "num_attention_heads": template("dim"),
    "num_key_value_heads": optional("dim"),
    "head_dim": optional("dim"),
    "rope_theta": optional("positive"),
    "rope_scaling": optional("rope"),
    "rope_parameters": optional("rope"),
    "partial_rotary_factor": optional("fraction"),
}

# Keys of the families the runtime builds.
RUNTIME_KEYS: dict[str, Key] = {
    "hidden_act": default(("silu",), "silu"),
    "tie_word_embeddings": default((False,), False),   # the builds load lm_head.weight on its own
}


def keys(*tables: Mapping[str, Key]) -> dict[str, Key]:
    """Key tables merged in order: a later table's key replaces an earlier one's in its place."""
    out: dict[str, Key] = {}
    for table in tables:
        out |= table
    return out


# -- cross-key checks (each raises ConfigError naming the key) ----------------------------------------


def layer_list(config: Config, key: str) -> None:
    values = config.get(key)
    if values is None:
        return
    bad = [v for v in values if v >= config["num_hidden_layers"]]
    if bad or len(set(values)) != len(values):
        raise ConfigError((key,), f"{key} must list distinct layer indices below num_hidden_layers "
                               f"{config['num_hidden_layers']}; got {values!r}"[:300])


def per_layer(config: Config, key: str) -> None:
    values = config.get(key)
    if values is not None and len(values) != config["num_hidden_layers"]:
        raise ConfigError((key,), f"{key} has {len(values)} entries; it needs one per layer (num_hidden_layers "
                               f"{config['num_hidden_layers']})")


def no_check(config: Config) -> None:
    """A family without checks across its keys."""


def as_published(config: Config) -> Config:
    """A config.json already in its published spelling (every family but those that say otherwise)."""
    return config


# -- layer layouts and normalization hooks -------------------------------------------------------------


def every_layer(config: Config) -> tuple[int, ...]:
    return tuple(range(config["num_hidden_layers"]))


def gqa_head_dim(c: Config) -> int:
    """The per-head dimension rotary turns: `head_dim`, else hidden_size // heads (transformers' fallback)."""
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def full_attention(c: Config) -> tuple:
    """One window per layer: none (the family attends over the whole context whatever the config says)."""
    return (None,) * c["num_hidden_layers"]


def every_layer_attends(c: Config) -> None:
    """No linear-attention layers: every layer's token mixer is the family's attention."""
    return None


def no_rotary_factor(config: Config, defaults: Config) -> float | None:
    return None


def describe_gqa(c: Config, rotary: str, base) -> tuple[str, str]:
    """The summary's attention and rotary phrases for grouped-query attention."""
    attention = f"GQA attention, {c['num_attention_heads']} query / {c['num_key_value_heads']} key-value heads of {c['head_dim']}"
    windows = sorted({w for w in c["sliding_windows"] if w is not None})
    if windows:
        attention += ", sliding window " + ", ".join(str(w) for w in windows) + (" on alternate layers" if None in c["sliding_windows"] else "")
    return attention, f"{rotary} on {c['rope']['rotary_dim']} of {c['head_dim']} dims (base {base})"


@dataclass(frozen=True)
class FamilySpec:
    """One architecture family, whole: what registry resolves (layers, shape, checkpoint names) and what
    codegen renders (`families/<name>/modeling.py.j2` and the hooks below)."""

    name: str
    runtime: bool                            # the runtime builds it (a template exists); else it resolves and explains only
    architectures: tuple[str, ...]           # config.json "architectures" values it reads
    keys: Mapping[str, Key]                  # every [config] key the family reads, in declaration order
    moe_layers: Callable[[Config], tuple[int, ...]]
    experts_key: str                         # the config key of the routed experts count
    intermediate_key: str                    # the config key of one expert's intermediate size
    activation: str = "silu_glu"
    expert_bias: bool = False
    check: Callable[[Config], None] = no_check   # checks across keys, after the shared ones
    experts_prefix: str = "model.layers.{layer}.mlp.experts"     # "{layer}" = decoder layer index
    draft_experts_prefix: str | None = None  # "{layer}" = absolute index, "{k}" = draft layer number
    draft_count_key: str | None = None       # the config key of the number of draft (MTP) layers
    expert_members: tuple[str, ...] = ("0.gate_proj", "0.up_proj", "0.down_proj")  # for exclusion patterns
    # transformers >= 5 writes some keys under its canonical name where the hub files (and so the
    # declarations) use the published one: canonical -> published (import-checkpoint).
    published_names: Mapping[str, str] = field(default_factory=dict)
    # Where transformers >= 5 respells a key's structure, not just its name (Nemotron-H's layers_block_type
    # for hybrid_override_pattern): config.json as saved -> its published spelling (import-checkpoint).
    published_form: Callable[[Config], Config] = as_published
    # What a runtime family's build is made of (read by codegen; unused where runtime is False).
    router: str = ""                         # the runtime.routing class of its MoE gate
    attention_ops: tuple[str, ...] = ("GQAttention",)   # runtime.ops names its attention is built from
    mlp_attr: str = "mlp"                    # the decoder layer's MoE attribute (the checkpoint's name)
    shared_experts: bool = False             # a shared-experts MLP in every MoE block
    experts_storage: str = "gate_up_down"    # how its checkpoints store routed experts (runtime.checkpoint.writer)
    head_dim: Callable[[Config], int] = gqa_head_dim   # the dimension rotary turns per head
    stores_head_dim: bool = True             # `head_dim` is a constant its template inlines
    rotary_factor: Callable[[Config, Config], float | None] = no_rotary_factor   # a legacy spelling of partial_rotary_factor
    sliding_windows: Callable[[Config], tuple] = full_attention
    # A hybrid family's layers with full attention (the others run its linear mixer); None: every layer.
    attention_layers: Callable[[Config], tuple[int, ...] | None] = every_layer_attends
    describe_attention: Callable[[Config, str, Any], tuple[str, str]] = describe_gqa
    mtp_draft: bool = False                  # the runtime builds its embedded and replacement-head MTP drafts
    # Where the MTP layers are a tree of their own (Qwen3-Next's, Nemotron-H's `mtp`): the target skips all of
    # it and the draft is `runtime.draft_build.PredictorMTPDraft`, built by the template's `make_mtp`.
    mtp_tree: str | None = None
    mtp_predictor: str | None = None         # the runtime.ops class of that tree (imported where a build makes it)
    # The draft MoE layers' indices inside the MTP tree, where they are not 0, 1, ... (Nemotron-H's: the `E`
    # letters of mtp_hybrid_override_pattern); their number is then the draft's MoE layer count.
    draft_moe_sites: Callable[[Config], tuple[int, ...]] | None = None
    # The checkpoint's names of the backbone, its embedding and final norm (as its template's `Architecture(names=)`).
    backbone_names: tuple[str, str, str] = ("model", "embed_tokens", "norm")
    mtp_refusal: str | None = None           # why no embedded MTP draft is built although the config declares one

    def shape(self, config: Config) -> MoeShape:
        return MoeShape(
            hidden_size=config["hidden_size"],
            intermediate_size=config[self.intermediate_key],
            num_experts=config[self.experts_key],
            top_k=config["num_experts_per_tok"],
            activation=self.activation,
            expert_bias=self.expert_bias,
        )

    def num_draft_layers(self, config: Config) -> int:
        count = config.get(self.draft_count_key, 0) if self.draft_count_key else 0
        return len(self.draft_moe_sites(config)) if count and self.draft_moe_sites else count

    def experts_module(self, layer: int) -> str:
        return self.experts_prefix.format(layer=layer)

    def draft_experts_module(self, config: Config, k: int) -> str:
        assert self.draft_experts_prefix is not None
        site = self.draft_moe_sites(config)[k] if self.draft_moe_sites else k
        return self.draft_experts_prefix.format(layer=config["num_hidden_layers"] + k, k=site)

    def draft_ignore(self, config: Config) -> tuple[str, ...]:
        """fnmatch patterns of the draft layers' tensors a checkpoint carries beside the target's: one per
        draft layer (a broader pattern would hide a misnamed tensor of the target)."""
        count = int(self.num_draft_layers(config) or 0) if self.draft_experts_prefix else 0
        if not count:
            return ()
        if self.mtp_tree:
            return (f"{self.mtp_tree}.*",)
        base = int(config["num_hidden_layers"])
        if self.draft_experts_prefix.startswith("model.layers."):
            return tuple(f"model.layers.{base + k}.*" for k in range(count))
        # A separate tree (MiniMax-M2's `model.mtp_modules.{k}`): everything under each module.
        module = self.draft_experts_prefix.split("{k}")[0]
        return tuple(f"{module}{k}.*" for k in range(count))

"""The typed model of a declaration file (`registry/models/<model>.toml`): pydantic models, frozen, `extra="forbid"`, with the per-field and cross-entry checks that need no implementation registry.

Each cross-entry error (`FieldError`) knows the field it is about, so `registry.declarations` can
name its file and line. `Declaration.facts` is the model as the selection rules see it.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from contract import PARALLEL_NAME, Honored, Layout, layout_grammar
from families import FAMILIES
from families.base import FamilySpec
from registry.configs import CONFIGS, ConfigError, validate_config, validate_eagle3
from registry.errors import DeclarationError, MoegenError
from registry.formats import CHECKPOINT_ALGOS, CheckpointQuant, expert_format
from registry.model import DRAFT_KINDS, SPEC_MODES, DraftFacts, ModelFacts, MoeSite, layout_of
from registry.selection import Selection

TOKEN = r"^[a-z][a-z0-9_]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    name: str = Field(pattern=TOKEN)
    family: str
    doc: str = Field(min_length=1)

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(f"unknown family {value!r}; families: {', '.join(FAMILIES)}")
        return value


class Policies(_Strict):
    default_routed_format: str | None = None          # FN1, a quant algorithm such as "MXFP4"
    excluded_layers: Literal["tactic", "backend"] = "tactic"   # FN5

    @field_validator("default_routed_format")
    @classmethod
    def _known_format(cls, value):
        """A model policy names a format moegen knows: a typo such as "MXFP5" is caught at its line,
        not at resolution as a format no implementation serves."""
        if value is not None and value.upper() not in CHECKPOINT_ALGOS:
            raise ValueError(f"unknown expert format {value!r}; known: {', '.join(CHECKPOINT_ALGOS)}")
        return value


class CheckpointDecl(_Strict):
    name: str = Field(pattern=TOKEN)
    doc: str = ""
    quant_algo: str | None = None
    exclude_modules: tuple[str, ...] = ()
    quantized_layers: dict[str, str] = Field(default_factory=dict)

    def quant(self) -> CheckpointQuant:
        return CheckpointQuant(self.quant_algo, self.exclude_modules, tuple(sorted(self.quantized_layers.items())))


# What an Eagle3 head's config must give (its one decoder layer, its vocabularies, the target's width).
EAGLE3_KEYS = ("vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "intermediate_size",
               "num_attention_heads", "num_key_value_heads", "head_dim")
# The keys _cross_checks reads from an Eagle3 config with messages of its own (registry.configs types the rest).
EAGLE3_CHECKED = EAGLE3_KEYS + ("eagle_aux_hidden_state_layer_ids",)


class DraftDecl(_Strict):
    name: str = Field(pattern=TOKEN)
    kind: Literal[DRAFT_KINDS]  # type: ignore[valid-type]
    modes: tuple[str, ...] = Field(min_length=1)
    doc: str = ""
    vanilla_with_target: bool = False                   # DR5
    num_layers: int | None = Field(default=None, ge=0)  # draft stages / replacement heads
    experts_prefix: str | None = None                   # "{k}" = draft layer number
    family: str | None = None                           # external / eagle3: the drafter's own family
    config: dict[str, Any] | None = None                # ... and its own config (typed by Declaration)
    checkpoint: CheckpointDecl | None = None            # own quant metadata (external, replacement_mtp)

    @field_validator("modes")
    @classmethod
    def _known_modes(cls, value):
        bad = [m for m in value if m not in SPEC_MODES]
        if bad:
            raise ValueError(f"unknown speculative modes {bad}; modes: {', '.join(SPEC_MODES)}")
        return value

    @model_validator(mode="after")
    def _needs(self):
        if self.kind in ("external", "replacement_mtp") and self.checkpoint is None:
            article = "an" if self.kind[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.kind} draft has its own checkpoint: add [drafts.checkpoint] with its quant metadata")
        if self.kind == "draft_stages" and (self.num_layers is None or self.experts_prefix is None):
            raise ValueError("draft stages need num_layers and experts_prefix (with '{k}' for the stage number)")
        if self.kind == "eagle3" and (self.config is None or self.checkpoint is None):
            raise ValueError(f"an Eagle3 draft has its own checkpoint and config: add [drafts.checkpoint] and a config with "
                             f"{', '.join(EAGLE3_KEYS)}")
        if self.kind == "external" and (self.family is None or self.config is None):
            raise ValueError("an external drafter needs its own family and config")
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; families: {', '.join(FAMILIES)}")
        if self.experts_prefix is not None:
            # An unknown placeholder would otherwise raise KeyError from str.format when facts are built.
            try:
                self.experts_prefix.format(k=0, layer=0)
            except (KeyError, IndexError, ValueError):
                raise ValueError(
                    f"experts_prefix {self.experts_prefix!r} may use only {{k}} (the draft layer number) and "
                    "{layer} (the absolute layer index)"
                ) from None
        return self


class ProfileDecl(_Strict):
    tp: int = Field(ge=1)
    moe_tp: int = Field(ge=1)
    ep: int = Field(ge=1)
    dp: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _covers(self):
        if self.moe_tp * self.ep != self.tp * self.dp:
            raise ValueError(f"moe_tp x ep = {self.moe_tp * self.ep} must equal tp x dp = {self.tp * self.dp}")
        return self


class _SelectionFields(_Strict):
    def selection(self) -> Selection:
        return Selection(**self.model_dump())


# A target's [targets.selection]: exactly the fields of registry.selection.Selection (stated there once),
# checked strictly like every other table.
SelectionDecl = create_model(
    "SelectionDecl", __base__=_SelectionFields,
    **{f.name: (get_type_hints(Selection)[f.name], f.default) for f in fields(Selection)},
)


class TargetDecl(_Strict):
    checkpoint: str
    sm: int = Field(ge=10, le=999)
    parallel: str = Field(pattern=PARALLEL_NAME.pattern)
    doc: str = ""
    moe_impls_honored: tuple[str, ...] | Literal["*"] | None = None
    draft_moe_impls_honored: tuple[str, ...] | Literal["*"] | None = None
    selection: SelectionDecl = SelectionDecl()

    @field_validator("moe_impls_honored", "draft_moe_impls_honored", mode="before")
    @classmethod
    def _honored_shape(cls, value):
        """One clear message for a value of the wrong shape (pydantic alone reports the union's first
        member: `targets[0].moe_impls_honored.tuple[str, ...]: Input should be a valid tuple`)."""
        Honored.parse(value)   # refuses any other shape (a ValueError, which pydantic reports at the field)
        return value

    @property
    def name(self) -> str:
        return f"{self.checkpoint}__sm_{self.sm}__{self.parallel}"

    def honored(self, draft: bool = False) -> Honored:
        return Honored.parse(self.draft_moe_impls_honored if draft else self.moe_impls_honored)


class Declaration(_Strict):
    model: ModelSection
    config: dict[str, Any]     # the family's typed keys only (registry.configs), as the file gives them
    policies: Policies = Policies()
    checkpoints: tuple[CheckpointDecl, ...] = Field(min_length=1)
    drafts: tuple[DraftDecl, ...] = ()
    parallel_profiles: dict[str, ProfileDecl] = Field(default_factory=dict)
    targets: tuple[TargetDecl, ...] = ()

    @property
    def family(self) -> FamilySpec:
        return FAMILIES[self.model.family]

    def checkpoint(self, name: str) -> CheckpointDecl:
        # Names come from users too (`explain --checkpoint`): an unknown one is a declaration error.
        found = next((c for c in self.checkpoints if c.name == name), None)
        if found is None:
            declared = ", ".join(c.name for c in self.checkpoints)
            raise DeclarationError(f"model {self.model.name} has no checkpoint {name!r}; its checkpoints: {declared}")
        return found

    def layout(self, parallel: str) -> Layout:
        profiles = {k: Layout(p.tp, p.moe_tp, p.ep, p.dp) for k, p in self.parallel_profiles.items()}
        return layout_of(parallel, profiles)

    def facts(self, checkpoint: str | None = None) -> ModelFacts:
        """The model as the selection rules see it, for one of its checkpoints (default: the first)."""
        ckpt = self.checkpoint(checkpoint) if checkpoint else self.checkpoints[0]
        family = self.family
        quant = ckpt.quant()
        default = self.policies.default_routed_format
        sites = tuple(
            MoeSite(i, family.experts_module(i), expert_format(quant, family.experts_module(i), family.expert_members, default))
            for i in family.moe_layers(self.config)
        )
        return ModelFacts(
            model=self.model.name,
            family=family.name,
            checkpoint=ckpt.name,
            shape=family.shape(self.config),
            sites=sites,
            excluded_layers=self.policies.excluded_layers,
            drafts=tuple(self._draft_facts(d, quant) for d in self.drafts),
        )

    def _draft_facts(self, draft: DraftDecl, target_quant: CheckpointQuant) -> DraftFacts:
        family = self.family
        if draft.kind == "eagle3":
            # One dense decoder layer: no MoE layer for a draft selection to bind.
            return DraftFacts(draft.name, draft.kind, draft.modes, (), None, draft.vanilla_with_target)
        if draft.kind == "external" and draft.config is not None:
            own = FAMILIES[draft.family or family.name]
            quant = draft.checkpoint.quant() if draft.checkpoint else CheckpointQuant()
            modules = [own.experts_module(i) for i in own.moe_layers(draft.config)]
            members, shape, layers = own.expert_members, own.shape(draft.config), own.moe_layers(draft.config)
        else:
            quant = draft.checkpoint.quant() if draft.checkpoint else target_quant
            count = draft.num_layers if draft.num_layers is not None else family.num_draft_layers(self.config)
            base = self.config["num_hidden_layers"]
            if draft.experts_prefix:
                modules = [draft.experts_prefix.format(k=k, layer=base + k) for k in range(count)]
            else:
                modules = [family.draft_experts_module(self.config, k) for k in range(count)]
            members, shape, layers = family.expert_members, family.shape(self.config), tuple(base + k for k in range(count))
        sites = tuple(MoeSite(layer, m, expert_format(quant, m, members)) for layer, m in zip(layers, modules))
        return DraftFacts(draft.name, draft.kind, draft.modes, sites, shape, draft.vanilla_with_target)

    @model_validator(mode="before")
    @classmethod
    def _typed_configs(cls, data):
        """Type and range-check the model's [config] and each drafter's own config by their family
        (RULES GN4), before anything reads them; a family that is unknown is reported by its field."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            return data
        family = data["model"].get("family")
        data = dict(data)
        if isinstance(family, str) and family in CONFIGS and isinstance(data.get("config"), dict):
            data["config"] = _typed(partial(validate_config, family), data["config"], ("config",), "[config]")
        if isinstance(data.get("drafts"), list):
            drafts = []
            for n, draft in enumerate(data["drafts"]):
                own = draft.get("family") or family if isinstance(draft, dict) else None
                loc = ("drafts", n, "config")
                # An Eagle3 head's config is no family's: typed as the head it builds, its shape keys checked by
                # _cross_checks one by one.
                if isinstance(draft, dict) and draft.get("kind") == "eagle3" and isinstance(draft.get("config"), dict):
                    draft = draft | {"config": _typed(partial(validate_eagle3, checked=EAGLE3_CHECKED), draft["config"],
                                                      loc, "the Eagle3 config")}
                elif isinstance(own, str) and own in CONFIGS and isinstance(draft.get("config"), dict):
                    draft = draft | {"config": _typed(partial(validate_config, own), draft["config"], loc,
                                                      "the drafter's config")}
                drafts.append(draft)
            data["drafts"] = drafts
        return data

    @model_validator(mode="after")
    def _cross_checks(self):
        # Each error is located at the table or entry it is about, not at the file's first line.
        for name, profile in self.parallel_profiles.items():
            if layout_grammar(name):
                raise FieldError(
                    ("parallel_profiles", name),
                    f"profile {name!r} is named like a parallel layout (tp<N>, tp<N>_moetp<X>ep<Y>, dep<N>), which "
                    f"means something of its own; this profile declares {profile.tp * profile.dp} ranks "
                    f"(tp {profile.tp}, moe_tp {profile.moe_tp}, ep {profile.ep}, dp {profile.dp}): rename it (e.g. low_latency)",
                )
        for n, draft in enumerate(self.drafts):
            # An Eagle3 head's config is its own (not a family's): checked here, key by key.
            if draft.kind == "eagle3" and draft.config is not None:
                for key in EAGLE3_KEYS:
                    value = draft.config.get(key)
                    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                        raise FieldError(("drafts", n, "config"), f"the Eagle3 config needs {key} as a positive integer, got {value!r}; set it")
                if draft.config["target_hidden_size"] != self.config.get("hidden_size"):
                    raise FieldError(("drafts", n, "config", "target_hidden_size"),
                                      f"the Eagle3 draft {draft.name} has target_hidden_size {draft.config['target_hidden_size']!r} "
                                      f"and the target hidden_size {self.config.get('hidden_size')!r}; set it to the target's")
                layers = self.config["num_hidden_layers"]
                ids = draft.config.get("eagle_aux_hidden_state_layer_ids", [2, layers // 2, layers - 3])
                if (not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids)
                        or not all(1 <= i <= layers for i in ids)):
                    raise FieldError(("drafts", n, "config"),
                                      f"eagle_aux_hidden_state_layer_ids must be three layer indices in [1, {layers}] (vLLM's "
                                      f"convention: the state entering that layer), got {ids!r}; fix them")
                if draft.config["vocab_size"] != self.config.get("vocab_size"):
                    raise FieldError(("drafts", n, "config", "vocab_size"),
                                      f"the Eagle3 draft {draft.name} has vocab_size {draft.config['vocab_size']!r} and the target "
                                      f"{self.config.get('vocab_size')!r}: vocab_size is the target's (draft_vocab_size is the draft's own)")
            # An external drafter proposes ids the target verifies as its own: one vocabulary (Eagle3 maps
            # its draft vocabulary through d2t instead).
            if draft.kind == "external" and draft.config is not None and draft.config.get("vocab_size") != self.config.get("vocab_size"):
                raise FieldError(
                    ("drafts", n, "config", "vocab_size"),
                    f"the external drafter {draft.name} has vocab_size {draft.config.get('vocab_size')!r} and the target "
                    f"{self.config.get('vocab_size')!r}: an external drafter shares the target's vocabulary; declare a "
                    "drafter with the target's tokenizer",
                )
        names = [c.name for c in self.checkpoints]
        for n, name in enumerate(names):
            if name in names[:n]:
                raise FieldError(("checkpoints", n, "name"), f"checkpoint {name!r} is declared twice; rename one")
        seen = set()
        for n, target in enumerate(self.targets):
            if target.checkpoint not in names:
                raise FieldError(("targets", n, "checkpoint"), f"checkpoint {target.checkpoint!r} is not declared; declared: {', '.join(names)}")
            if target.name in seen:
                raise FieldError(("targets", n), f"target {target.name} is declared twice")
            seen.add(target.name)
            try:
                self.layout(target.parallel)
            except MoegenError as exc:
                raise FieldError(("targets", n, "parallel"), str(exc)) from None
        return self


class FieldError(ValueError):
    """A cross-entry error that knows which field it is about (for file:line)."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def _typed(validate, config: dict, loc: tuple, table: str) -> dict:
    """`validate(config)`, the typed config, or a FieldError at the key it refuses (`table` names a refusal of
    the whole table)."""
    try:
        return validate(config)
    except ConfigError as exc:
        message = f"{table} {exc}" if not exc.key else str(exc)
        raise FieldError(loc + exc.key, message) from None

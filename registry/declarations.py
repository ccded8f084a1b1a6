"""Model declaration files (`registry/models/<model>.toml`): typed, validated, located (file:line).

One file per model: its architecture family and HF-style config (each number's source in a comment),
its checkpoints' quant metadata, its drafts, policies, parallel profiles and targets. Every error
names the file, the line and the field, and says how to fix it. Cross-entry rules that need the
implementation registry (TG2) run after the per-field checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from contract import PARALLEL_NAME, Honored, Layout, layout_grammar
from registry.configs import CONFIGS, ConfigError, validate_config
from registry.eligibility import Deployment, Problem, eligibility
from registry.errors import DeclarationError, MoegenError
from registry.families import FAMILIES, FamilySpec
from registry.formats import CHECKPOINT_ALGOS, CheckpointQuant, expert_format
from registry.impls import AUTO, Registry, load_registry
from registry.inputs import read_toml
from registry.model import SPEC_MODES, DraftFacts, ModelFacts, MoeSite, layout_of
from registry.selection import Selection, check_selection
from registry.toml_lines import line_of

MODELS_DIR = Path(__file__).with_name("models")
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


class DraftDecl(_Strict):
    name: str = Field(pattern=TOKEN)
    kind: Literal["embedded_mtp", "replacement_mtp", "external", "eagle3", "draft_stages"]
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


class SelectionDecl(_Strict):
    backend: str = AUTO
    tactic: str | None = None
    eplb: bool = False
    spec_mode: str | None = None
    draft_backend: str | None = None
    draft_tactic: str | None = None

    def selection(self) -> Selection:
        return Selection(**self.model_dump())


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
            data["config"] = _typed(family, data["config"], ("config",), "[config]")
        if isinstance(data.get("drafts"), list):
            drafts = []
            for n, draft in enumerate(data["drafts"]):
                own = draft.get("family") or family if isinstance(draft, dict) else None
                # An Eagle3 head's config is no family's: _cross_checks reads it key by key.
                if (isinstance(own, str) and own in CONFIGS and isinstance(draft.get("config"), dict)
                        and draft.get("kind") != "eagle3"):
                    draft = draft | {"config": _typed(own, draft["config"], ("drafts", n, "config"), "the drafter's config")}
                drafts.append(draft)
            data["drafts"] = drafts
        return data

    @model_validator(mode="after")
    def _cross_checks(self):
        # Each error is located at the table or entry it is about, not at the file's first line.
        for name, profile in self.parallel_profiles.items():
            if layout_grammar(name):
                raise _FieldError(
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
                        raise _FieldError(("drafts", n, "config"), f"the Eagle3 config needs {key} as a positive integer, got {value!r}; set it")
                if draft.config["target_hidden_size"] != self.config.get("hidden_size"):
                    raise _FieldError(("drafts", n, "config", "target_hidden_size"),
                                      f"the Eagle3 draft {draft.name} has target_hidden_size {draft.config['target_hidden_size']!r} "
                                      f"and the target hidden_size {self.config.get('hidden_size')!r}; set it to the target's")
                layers = self.config["num_hidden_layers"]
                ids = draft.config.get("eagle_aux_hidden_state_layer_ids", [2, layers // 2, layers - 3])
                if (not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids)
                        or not all(1 <= i <= layers for i in ids)):
                    raise _FieldError(("drafts", n, "config"),
                                      f"eagle_aux_hidden_state_layer_ids must be three layer indices in [1, {layers}] (vLLM's "
                                      f"convention: the state entering that layer), got {ids!r}; fix them")
                if draft.config["vocab_size"] != self.config.get("vocab_size"):
                    raise _FieldError(("drafts", n, "config", "vocab_size"),
                                      f"the Eagle3 draft {draft.name} has vocab_size {draft.config['vocab_size']!r} and the target "
                                      f"{self.config.get('vocab_size')!r}: vocab_size is the target's (draft_vocab_size is the draft's own)")
            # An external drafter proposes ids the target verifies as its own: one vocabulary (Eagle3 maps
            # its draft vocabulary through d2t instead).
            if draft.kind == "external" and draft.config is not None and draft.config.get("vocab_size") != self.config.get("vocab_size"):
                raise _FieldError(
                    ("drafts", n, "config", "vocab_size"),
                    f"the external drafter {draft.name} has vocab_size {draft.config.get('vocab_size')!r} and the target "
                    f"{self.config.get('vocab_size')!r}: an external drafter shares the target's vocabulary; declare a "
                    "drafter with the target's tokenizer",
                )
        names = [c.name for c in self.checkpoints]
        for n, name in enumerate(names):
            if name in names[:n]:
                raise _FieldError(("checkpoints", n, "name"), f"checkpoint {name!r} is declared twice; rename one")
        seen = set()
        for n, target in enumerate(self.targets):
            if target.checkpoint not in names:
                raise _FieldError(("targets", n, "checkpoint"), f"checkpoint {target.checkpoint!r} is not declared; declared: {', '.join(names)}")
            if target.name in seen:
                raise _FieldError(("targets", n), f"target {target.name} is declared twice")
            seen.add(target.name)
            try:
                self.layout(target.parallel)
            except MoegenError as exc:
                raise _FieldError(("targets", n, "parallel"), str(exc)) from None
        return self


class _FieldError(ValueError):
    """A cross-entry error that knows which field it is about (for file:line)."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


def _typed(family: str, config: dict, loc: tuple, table: str) -> dict:
    try:
        return validate_config(family, config)
    except ConfigError as exc:
        message = f"{table} {exc}" if not exc.key else str(exc)
        raise _FieldError(loc + exc.key, message) from None


def field_path(loc: tuple) -> str:
    """`targets[0].sm`; a key that is not a plain name is quoted (a key the user wrote may hold a line break)."""
    parts = [f"[{p}]" if isinstance(p, int) else (p if re.fullmatch(r"[A-Za-z0-9_]+", str(p)) else repr(str(p))) for p in loc]
    return ".".join(parts).replace(".[", "[")


def _fix_hint(error: dict) -> str:
    kind = error["type"]
    if kind == "missing":
        return "add it"
    if kind == "extra_forbidden":
        return "remove it or fix its spelling"
    return "fix the value"


def load_declaration(path: Path, registry: Registry | None = None, display: str | None = None) -> Declaration:
    """Read, validate and cross-check one declaration file; errors name file:line and field."""
    shown = display or str(path)
    text, data = read_toml(path, shown, DeclarationError)
    try:
        decl = Declaration.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(first["loc"])
        original = first.get("ctx", {}).get("error")
        if isinstance(original, _FieldError):
            loc = original.loc
            message = str(original)
        else:
            message = first["msg"].removeprefix("Value error, ")
            message = f"{message}; {_fix_hint(first)}" if first["type"] in ("missing", "extra_forbidden") else message
        raise DeclarationError(f"{shown}:{line_of(text, loc)}: {field_path(loc) or '(file)'}: {message}") from None
    _check_against_registry(decl, text, shown, registry or load_registry())
    stem = path.stem
    if decl.model.name != stem:
        raise DeclarationError(f"{shown}:{line_of(text, ('model', 'name'))}: model.name: {decl.model.name!r} must equal the file name {stem!r}")
    return decl


def _check_against_registry(decl: Declaration, text: str, shown: str, registry: Registry) -> None:
    """TG2: each honored id exists and passes every eligibility gate for at least one of the target's
    layers on its side; declared selections pass the parse-time checks (TA2, TA4, RQ1, RQ4)."""
    for n, target in enumerate(decl.targets):
        facts = decl.facts(target.checkpoint)
        layout = decl.layout(target.parallel)
        deployment = Deployment(sm=target.sm, moe_tp=layout.moe_tp, ep=layout.ep)
        for side, value in (("moe_impls_honored", target.moe_impls_honored), ("draft_moe_impls_honored", target.draft_moe_impls_honored)):
            draft = side == "draft_moe_impls_honored"
            if target.honored(draft).restricts is None:
                continue   # "*" or left out: no id to check
            layers = _side_layers(facts, draft, target.sm, registry)
            formats = set().union(*(f for _, f, _ in layers))
            for k, impl_id in enumerate(value):
                where = f"{shown}:{line_of(text, ('targets', n, side, k))}: targets[{n}].{side}"
                impl = registry.by_id.get(impl_id)
                if impl is None:
                    raise DeclarationError(f"{where}: {impl_id!r} is not a registered implementation id; see `python -m codegen catalog` (RULES TG2)")
                if not impl.runs_on(target.sm) or impl.format not in formats:
                    raise DeclarationError(
                        f"{where}: {impl_id} is not eligible on sm_{target.sm} for any of this target's "
                        f"{'draft ' if draft else ''}layer formats ({', '.join(sorted(formats)) or 'none'}); "
                        "list an implementation that can serve them (RULES TG2)"
                    )
                rejections = [
                    eligibility(impl, Problem.of(impl.format, shape), deployment)
                    for _, fmts, shape in layers if impl.format in fmts
                ]
                if all(rejections):
                    raise DeclarationError(
                        f"{where}: {impl_id} is not eligible for any of this target's {'draft ' if draft else ''}layers "
                        f"on sm_{target.sm} with parallel {target.parallel}: {rejections[0].describe()}; "
                        "list an implementation that can serve them (RULES TG2)"
                    )
        try:
            check_selection(target.selection.selection(), registry)
        except MoegenError as exc:
            raise DeclarationError(f"{shown}:{line_of(text, ('targets', n, 'selection'))}: targets[{n}].selection: {exc}") from None


def _side_layers(facts: ModelFacts, draft: bool, sm: int, registry: Registry) -> list[tuple[int, set[str], Any]]:
    """(layer, run formats it can run as on this SM, experts shape) per MoE layer of a side (an MXFP4
    layer: any of the SM's MXFP4 run formats)."""
    sides = [(s, d.shape) for d in facts.drafts for s in d.sites] if draft else [(s, facts.shape) for s in facts.sites]
    out = []
    for site, shape in sides:
        fmt = site.format.format
        out.append((site.layer, set(registry.mxfp4_preference(sm) or ()) if fmt == "mxfp4" else {fmt}, shape))
    return out


def load_models(models_dir: Path | None = None, registry: Registry | None = None) -> dict[str, Declaration]:
    """Every declaration: the project's own, then a user's `--models DIR` (a name in both is an error)."""
    registry = registry or load_registry()
    decls: dict[str, Declaration] = {}
    dirs = [MODELS_DIR] + ([models_dir] if models_dir else [])
    for directory in dirs:
        if not directory.is_dir():
            raise DeclarationError(f"--models {directory}: not a folder of declaration files")
        for path in sorted(directory.glob("*.toml")):
            display = f"registry/models/{path.name}" if directory == MODELS_DIR else str(path)
            decl = load_declaration(path, registry, display)
            if decl.model.name in decls:
                raise DeclarationError(f"{display}: model {decl.model.name!r} is already declared by the project; rename it")
            decls[decl.model.name] = decl
    return decls


def find_model(name: str, decls: dict[str, Declaration]) -> Declaration:
    if name not in decls:
        import difflib

        close = difflib.get_close_matches(name, list(decls), n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise DeclarationError(f"unknown model {name!r}; {hint}models: {', '.join(sorted(decls))}")
    return decls[name]


def deployment_for(decl: Declaration, target: TargetDecl, eplb: bool = False) -> Deployment:
    layout = decl.layout(target.parallel)
    return Deployment(sm=target.sm, moe_tp=layout.moe_tp, ep=layout.ep, eplb=eplb)


def resolve_target(decl: Declaration, target: TargetDecl, selection: Selection, registry: Registry | None = None):
    """A selection resolved on one target's SM and layout, with its honored ids (TG3, TG4)."""
    from registry.model_resolve import resolve_model

    layout = decl.layout(target.parallel)
    return resolve_model(
        decl.facts(target.checkpoint),
        selection,
        sm=target.sm,
        moe_tp=layout.moe_tp,
        ep=layout.ep,
        registry=registry,
        honored=target.honored(),
        draft_honored=target.honored(draft=True),
    )


def matching_targets(decl: Declaration, sm: int | None = None, parallel: str | None = None, checkpoint: str | None = None) -> list[TargetDecl]:
    """The model's targets on an SM / layout / checkpoint (None matches any), in declaration order."""
    return [
        t
        for t in decl.targets
        if (sm is None or t.sm == sm) and (parallel is None or t.parallel == parallel) and (checkpoint is None or t.checkpoint == checkpoint)
    ]

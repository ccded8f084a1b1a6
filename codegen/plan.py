"""Build plans: a target and a selection become everything a generated build needs, as plain data.

A plan is what templates read and what fingerprints hash (RULES GN2): each generated file's fingerprint
covers what its text is rendered from (`BuildPlan.fingerprint`: the build's Python files, which read the
plan's decisions but not the alternatives and rejections only `resolution.json` lists), so an
implementation added elsewhere in the registry leaves the bytes of a build that does not bind it alone. Equivalent
spellings of a tactic give equal plans: a tactic is re-spelled canonically before it is resolved,
so even the messages a plan records (warnings, refusals) read the same whatever the user typed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass, replace

from registry.build_index import bound_layers
from registry.declarations import Declaration, TargetDecl, resolve_target
from registry.impls import Registry, load_registry
from registry.model import NON_NEURAL_MODES, facts_to_literal
from registry.model_resolve import ModelResolution
from registry.resolve import moe_impl_request
from registry.selection import DRAFT_TACTIC, TARGET_TACTIC, Selection, check_selection


@dataclass(frozen=True)
class LayerPlan:
    index: int
    kind: str                    # "dense" | "moe"
    impl: str | None = None      # bound implementation id (moe)
    class_path: str | None = None
    run_format: str | None = None
    role: str | None = None      # "target" | "excluded" | "draft"


@dataclass(frozen=True)
class LayerRun:
    """Consecutive decoder layers that bind the same implementation in the same role: one line of `LAYERS`."""
    start: int
    stop: int                    # exclusive, as range() takes it
    impl: str | None
    role: str | None


def layer_runs(layers: tuple[LayerPlan, ...]) -> tuple[LayerRun, ...]:
    """The layer table as `modeling.py` writes it: a run per stretch of equal (implementation, role)."""
    runs: list[LayerRun] = []
    for layer in layers:
        last = runs[-1] if runs else None
        if last is not None and (last.impl, last.role) == (layer.impl, layer.role) and last.stop == layer.index:
            runs[-1] = replace(last, stop=layer.index + 1)
        else:
            runs.append(LayerRun(layer.index, layer.index + 1, layer.impl, layer.role))
    return tuple(runs)


@dataclass(frozen=True)
class DraftPlan:
    name: str
    kind: str
    mode: str
    config: dict
    layers: tuple[LayerPlan, ...]


@dataclass(frozen=True)
class BuildPlan:
    model: str
    family: str
    target: str                  # a target name, or "generic"
    class_name: str
    checkpoint: str | None
    sm: int | None
    parallel: str | None
    layout: tuple[int, int, int, int] | None
    selection: dict
    config: dict
    layers: tuple[LayerPlan, ...]
    draft: DraftPlan | None
    moe_impls_honored: tuple | str | None        # contract.Honored.literal()
    draft_moe_impls_honored: tuple | str | None
    resolution: dict
    bound: tuple = ()
    facts: dict = field(default_factory=dict)   # generic builds: facts per checkpoint
    # What a build's files read of each bound implementation's registry entry: id -> (class, backend, runs on the CPU).
    bindings: dict = field(default_factory=dict)

    def canonical(self) -> str:
        return json.dumps(self, sort_keys=True, separators=(",", ":"), default=_plain)

    def code_inputs(self) -> dict:
        """What the build's Python files (modeling.py, draft.py) are rendered from: the plan with each layer
        kind's report reduced to its decision. The alternatives and rejections, which an implementation
        registered for the same layers changes, are `resolution.json`'s alone; the facts are `facts.py`'s."""
        inputs = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("resolution", "facts")}
        inputs["decisions"] = [{k: v for k, v in r.items() if k not in ("alternatives", "rejections")}
                               for r in self.resolution.get("layers", [])]
        return inputs

    @functools.cached_property
    def fingerprint(self) -> str:
        """The fingerprint of the build's Python files (cached: each file of a build carries it)."""
        return fingerprint(self.code_inputs())

    @property
    def bound_ids(self) -> tuple[str, ...]:
        ids = {l.impl for l in self.layers if l.impl} | ({l.impl for l in self.draft.layers if l.impl} if self.draft else set())
        return tuple(sorted(ids))


def fingerprint(*parts) -> str:
    """sha256 of the canonical JSON of `parts`: what a file's header states its text was rendered from."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_plain)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _plain(value):
    """JSON for what json.dumps does not know: dataclasses as their fields (as `asdict` gives them,
    without its deep copy), sets sorted so the text never depends on hash order."""
    if is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot put {type(value).__name__} into a build plan")


def canonical_spelling(selection: Selection) -> Selection:
    """The stored selection with each tactic in its shortest canonical spelling (pinned tokens in
    field order): `Eager.TORCH`, `torch.eager` and `*.eager.torch` all become `torch.eager`."""
    def respell(tactic, field_name):
        if tactic is None:
            return None
        return moe_impl_request(tactic, field=field_name).tactic.compact

    return replace(selection, tactic=respell(selection.tactic, TARGET_TACTIC), draft_tactic=respell(selection.draft_tactic, DRAFT_TACTIC))


def camel(*parts: str) -> str:
    return "".join(word[:1].upper() + word[1:] for part in parts for word in part.split("_") if word)


def class_name(decl: Declaration, target: TargetDecl | None) -> str:
    if target is None:
        return camel(decl.model.name, "generic") + "ForCausalLM"
    return camel(target.checkpoint, f"sm{target.sm}", target.parallel) + "ForCausalLM"


def resolution_dict(resolution: ModelResolution) -> dict:
    return {
        "model": resolution.model,
        "checkpoint": resolution.checkpoint,
        "sm": resolution.sm,
        "claimed": resolution.claimed,
        "refusals": list(resolution.refusals),
        "notes": list(resolution.notes),
        "warnings": list(resolution.warnings),
        "layers": [r.to_dict() for r in resolution.reports],
    }


def _layer_table(decl: Declaration, resolution: ModelResolution) -> tuple[LayerPlan, ...]:
    by_layer = {}
    for report in resolution.reports:
        if report.role == "draft":
            continue
        for i in report.layers:
            by_layer[i] = LayerPlan(i, "moe", report.winner, report.winner_class, report.run_format, report.role)
    return tuple(by_layer.get(i, LayerPlan(i, "dense")) for i in range(decl.config["num_hidden_layers"]))


def _draft_plan(decl: Declaration, selection: Selection, resolution: ModelResolution) -> DraftPlan | None:
    mode = selection.spec_mode
    if mode is None or mode in NON_NEURAL_MODES:
        return None
    draft = next(d for d in decl.drafts if mode in d.modes)
    layers = tuple(
        LayerPlan(i, "moe", r.winner, r.winner_class, r.run_format, "draft") for r in resolution.reports if r.role == "draft" for i in r.layers
    )
    config = dict(draft.config) if draft.config is not None else decl.config
    return DraftPlan(draft.name, draft.kind, mode, config, layers)


def target_plan(decl: Declaration, target: TargetDecl, selection: Selection | None = None,
                registry: Registry | None = None) -> tuple[BuildPlan, ModelResolution]:
    """The plan of one target under `selection` (default: its declared selection), resolved on `registry`
    (default: the project's)."""
    registry = registry or load_registry()
    selection = canonical_spelling(check_selection(selection or target.selection.selection()))
    resolution = resolve_target(decl, target, selection, registry)
    layout = decl.layout(target.parallel)
    plan = BuildPlan(
        model=decl.model.name,
        family=decl.family.name,
        target=target.name,
        class_name=class_name(decl, target),
        checkpoint=target.checkpoint,
        sm=target.sm,
        parallel=target.parallel,
        layout=layout.as_tuple(),
        selection=selection.canonical(),
        config=decl.config,
        layers=_layer_table(decl, resolution),
        draft=_draft_plan(decl, selection, resolution),
        moe_impls_honored=target.honored().literal(),
        draft_moe_impls_honored=target.honored(draft=True).literal(),
        resolution=resolution_dict(resolution),
        bound=tuple(bound_layers(resolution)),
        bindings={i: (registry.impl(i).class_path, registry.impl(i).backend, registry.impl(i).cpu)
                  for i in sorted({r.winner for r in resolution.reports if r.winner})},
    )
    return plan, resolution


def index_entry(plan: BuildPlan) -> dict:
    """A build's entry in the build index: its key, module, honored ids and what it binds (RULES TG6)."""
    return {
        "name": plan.target,
        "model": plan.model,
        "checkpoint": plan.checkpoint,
        "sm": plan.sm,
        "parallel": plan.parallel,
        "module": f".{plan.model}.{plan.target}.modeling",
        "class_name": plan.class_name,
        "moe_impls_honored": plan.moe_impls_honored,
        "draft_moe_impls_honored": plan.draft_moe_impls_honored,
        "spec_mode": plan.draft.mode if plan.draft else None,
        # The draft build the target holds (TG6: a target serves a speculative selection only with it).
        "draft": {"module": f".{plan.model}.{plan.target}.draft", "name": plan.draft.name, "kind": plan.draft.kind} if plan.draft else None,
        "bound": [[role, list(layers), impl] for role, layers, impl in plan.bound],
    }


def generic_plan(decl: Declaration, selection: Selection | None = None) -> BuildPlan:
    """The model's generic build: it resolves each layer when it loads; `selection` is its default."""
    selection = canonical_spelling(check_selection(selection or Selection()))
    moe = set(decl.family.moe_layers(decl.config))
    return BuildPlan(
        model=decl.model.name,
        family=decl.family.name,
        target="generic",
        class_name=class_name(decl, None),
        checkpoint=None,
        sm=None,
        parallel=None,
        layout=None,
        selection=selection.canonical(),
        config=decl.config,
        layers=tuple(LayerPlan(i, "moe" if i in moe else "dense") for i in range(decl.config["num_hidden_layers"])),
        draft=None,
        moe_impls_honored=None,
        draft_moe_impls_honored=None,
        resolution={},
        facts={c.name: facts_to_literal(decl.facts(c.name)) for c in decl.checkpoints},
    )

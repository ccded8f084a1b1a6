"""The build index: pick the build that serves a deployment, a target's specialized build or the model's generic build.

Pure: it reads the generated index's literals (`_build_index.py`) and the resolution code, so
`generated.load_model` decides (and `explain` narrates) without importing torch (RULES TG5, TG6). `decide` is the one
decision: a specialized build is pre-bound, so it serves only a selection it claims, resolves to
exactly the implementations it was built with, and whose speculative mode finds its draft in it;
anything else goes to the generic build (`auto`), or fails naming the criterion that did not match
(`require`). `off` always uses the generic build.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import Honored, Layout
from registry.errors import NotHonoredError, SelectionError
from registry.layer_task import span
from registry.model import NON_NEURAL_MODES, ModelFacts
from registry.model_resolve import ModelResolution, resolve_model
from registry.selection import Selection

MODES = ("auto", "require", "off")


def bound_layers(resolution: ModelResolution) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(role, layers, implementation id) per layer kind: what a build binds."""
    return tuple((r.role, tuple(r.layers), r.winner) for r in resolution.reports)


@dataclass(frozen=True)
class Criterion:
    """One test of TG6: `ok` is None when an earlier failure leaves nothing to compare."""

    name: str                     # "claims" | "bound" | "draft"
    ok: bool | None
    text: str


@dataclass(frozen=True)
class Decision:
    """Whether one target's build serves a selection, criterion by criterion (RULES TG6)."""

    target: str
    module: str
    criteria: tuple[Criterion, ...]
    resolution: ModelResolution   # the selection under the target's honored ids

    @property
    def serves(self) -> bool:
        return all(c.ok for c in self.criteria)

    @property
    def reasons(self) -> tuple[str, ...]:
        """Each failed criterion, naming the target (what `load_model` logs and `require` raises)."""
        return tuple(f"{self.target}: {c.text}" for c in self.criteria if c.ok is False)


def decide(entry: dict, facts: ModelFacts, selection: Selection, layout: Layout) -> Decision:
    """TG6 for one target of the index: it serves only when it claims the selection (TG3, TG4), its
    build is bound to exactly what the selection resolves to, and it holds the draft the selection's
    speculative mode needs. `explain`, `generate` and `load_model` all decide here."""
    name = entry["name"]
    claimed = resolve_model(
        facts, selection, entry["sm"], layout.moe_tp, layout.ep,
        honored=Honored.parse(entry["moe_impls_honored"]), draft_honored=Honored.parse(entry["draft_moe_impls_honored"]),
    )
    now = _by_layers(bound_layers(claimed), draft=False)
    now_draft = _by_layers(bound_layers(claimed), draft=True)
    built = _by_layers(entry["bound"], draft=False)
    built_draft = _by_layers(entry["bound"], draft=True) if entry["spec_mode"] else {}
    unchecked = "not compared: the target does not claim this selection"
    if claimed.refusals:
        claims = Criterion("claims", False, "; ".join(claimed.refusals))
        bound = Criterion("bound", None, unchecked)
    else:
        claims = Criterion("claims", True, "claims this selection (RULES TG3, TG4)")
        if built == now:
            bound = Criterion("bound", True, f"built with what this selection resolves to: {_describe(built)}")
        else:
            bound = Criterion("bound", False, f"built with {_describe(built)}; this selection resolves to {_describe(now)}")
    mode = selection.spec_mode
    has = f"its draft for speculative_config.mode {entry['spec_mode']!r} ({_describe(built_draft)})" if entry["spec_mode"] else "no draft"
    if mode is None or mode in NON_NEURAL_MODES:
        what = "no speculative_config.mode" if mode is None else f"speculative_config.mode {mode!r} has no neural drafter"
        draft = Criterion("draft", True, f"needs no draft: {what}")
    elif entry["spec_mode"] != mode:
        draft = Criterion("draft", False, f"built with {has}; this selection needs a draft for mode {mode!r}")
    elif claimed.refusals:
        draft = Criterion("draft", None, unchecked)
    elif built_draft != now_draft:
        draft = Criterion("draft", False, f"built with {has}; this selection needs mode {mode!r} ({_describe(now_draft)})")
    else:
        draft = Criterion("draft", True, f"holds the draft this selection needs: {has}")
    return Decision(name, entry["module"], (claims, bound, draft), claimed)


def _by_layers(bound, draft: bool) -> dict:
    return {tuple(layers): impl for role, layers, impl in bound if (role == "draft") == draft}


@dataclass(frozen=True)
class BuildChoice:
    kind: str                     # "specialized" | "generic"
    target: str | None
    module: str
    reasons: tuple[str, ...]      # why no specialized build serves (shown under auto)
    resolution: ModelResolution


def matching(index: dict, facts: ModelFacts, sm: int, parallel: str) -> list[dict]:
    """The index's targets for (model, checkpoint, SM, parallel): the index's key (TG6)."""
    key = (facts.model, facts.checkpoint, sm, parallel)
    return [t for t in index["targets"] if (t["model"], t["checkpoint"], t["sm"], t["parallel"]) == key]


def pick_build(
    index: dict,
    facts: ModelFacts,
    sm: int,
    parallel: str,
    layout: Layout,
    selection: Selection,
    mode: str = "auto",
) -> BuildChoice:
    """Choose the build for (model, checkpoint, SM, parallel) under `selection` (TG5, TG6)."""
    if mode not in MODES:
        raise SelectionError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    model = index["models"][facts.model]

    def generic() -> ModelResolution:
        # Resolved only when the generic build serves: a specialized route has resolved already.
        return resolve_model(facts, selection, sm, layout.moe_tp, layout.ep)

    targets = matching(index, facts, sm, parallel)
    if mode == "off":
        return BuildChoice("generic", None, model["generic"], ("mode off: always the generic build",), generic())
    if not targets:
        declared = ", ".join(t["name"] for t in index["targets"] if t["model"] == facts.model) or "none"
        reason = f"no target of {facts.model} is declared for checkpoint {facts.checkpoint} on sm_{sm} with parallel {parallel} (declared: {declared})"
        return _generic_or_fail(mode, model, (reason,), generic)
    decision = decide(targets[0], facts, selection, layout)
    if not decision.serves:
        return _generic_or_fail(mode, model, decision.reasons, generic)
    return BuildChoice("specialized", decision.target, decision.module, (), decision.resolution)


def _describe(bound: dict) -> str:
    return "; ".join(f"{impl} for layers {span(layers)}" for layers, impl in sorted(bound.items())) or "nothing"


def _generic_or_fail(mode: str, model: dict, reasons: tuple[str, ...], generic) -> BuildChoice:
    if mode == "require":
        raise NotHonoredError("mode require: no specialized build serves this deployment: " + "; ".join(reasons) + " (RULES TG5)")
    return BuildChoice("generic", None, model["generic"], reasons, generic())

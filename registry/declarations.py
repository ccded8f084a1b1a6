"""Model declaration files (`registry/models/<model>.toml`): read, validated, located (file:line), and queried.

One file per model: its architecture family and HF-style config (each number's source in a comment),
its checkpoints' quant metadata, its drafts, policies, parallel profiles and targets; the typed model
is `registry.declaration_model`. Every error names the file, the line and the field, and says how to
fix it. Cross-entry rules that need the implementation registry (TG2) run after the per-field checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from contract import MoeShape
from registry.declaration_model import TOKEN, Declaration, TargetDecl, FieldError
from registry.eligibility import Deployment, Problem, eligibility
from registry.errors import DeclarationError, MoegenError
from registry.impls import Registry, load_registry
from registry.inputs import read_toml
from registry.model import ModelFacts
from registry.selection import Selection, check_selection
from registry.toml_lines import line_of

__all__ = ["MODELS_DIR", "TOKEN", "Declaration", "TargetDecl", "deployment_for", "field_path", "find_model", "load_declaration",
           "load_models", "matching_targets", "resolve_target"]

MODELS_DIR = Path(__file__).with_name("models")


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
        if isinstance(original, FieldError):
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
            formats = set().union(*(layer.formats for layer in layers))
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
                    eligibility(impl, Problem.of(impl.format, layer.shape), deployment)
                    for layer in layers if impl.format in layer.formats
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


@dataclass(frozen=True)
class _SideLayer:
    """One MoE layer of a side as TG2 checks it: the run formats it can run as on the SM (an MXFP4
    layer: any of the SM's MXFP4 run formats) and its experts shape."""

    formats: frozenset[str]
    shape: MoeShape | None


def _side_layers(facts: ModelFacts, draft: bool, sm: int, registry: Registry) -> list[_SideLayer]:
    sides = [(s, d.shape) for d in facts.drafts for s in d.sites] if draft else [(s, facts.shape) for s in facts.sites]
    mxfp4 = frozenset(registry.mxfp4_preference(sm) or ())
    return [_SideLayer(mxfp4 if site.format.format == "mxfp4" else frozenset({site.format.format}), shape) for site, shape in sides]


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

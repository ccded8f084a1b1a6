"""`generate` and `check`: which builds a command produces, where they go, and what it says.

Declared builds (a target with its declared selection, every generic build, the index, the catalog
and the schema) go to the repo's `generated/`; a selection that differs from a target's declared one
is an exploration and goes to `build/generated/` unless `--out` says otherwise. A target that does not
honor the selection is refused: under `auto` the model's generic build, bound to the selection, is
written instead; under `require` nothing is written and the command fails (RULES TG5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from codegen.files import Output, check_outputs, write_outputs
from codegen.outputs import ALL_COMMAND, build_outputs, docs_outputs, index_outputs, model_outputs
from codegen.plan import BuildPlan, generic_plan, target_plan
from registry.declarations import Declaration, find_model, matching_targets
from registry.errors import DeclarationError, NotHonoredError, SelectionError
from registry.families import RUNTIME_FAMILIES
from registry.impls import Registry, load_registry
from registry.selection import Selection

ROOT = Path(__file__).resolve().parent.parent
DECLARED_ROOT = "generated"
EXPLORE_ROOT = "build/generated"


@dataclass
class Generation:
    """Outputs per root folder, and what to tell the user."""

    roots: dict[str, list[Output]] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)

    def add(self, root: str, outputs: list[Output]) -> None:
        bucket = self.roots.setdefault(root, [])
        known = {o.path for o in bucket}
        bucket.extend(o for o in outputs if o.path not in known)


def buildable(decls: dict[str, Declaration]) -> list[Declaration]:
    return [d for _, d in sorted(d for d in decls.items()) if d.family.runtime]


def declared_generation(decls: dict[str, Declaration], registry: Registry) -> Generation:
    """Everything the repo's generated/ (and docs/, schemas/) must hold (ARCHITECTURE, "A generated build")."""
    gen = Generation()
    plans = []
    models = buildable(decls)
    for decl in models:
        gen.add(DECLARED_ROOT, model_outputs(decl, generic_plan(decl), registry))
        for target in decl.targets:
            plan, _ = target_plan(decl, target)
            plans.append(plan)
            gen.add(DECLARED_ROOT, build_outputs(decl, plan, registry))
    gen.add(DECLARED_ROOT, index_outputs([d.model.name for d in models], plans))
    gen.add(".", docs_outputs(registry))
    return gen


def _flags(selection: Selection) -> str:
    """The selection as command-line flags, canonical so equal selections give equal headers."""
    canon = selection.canonical()
    parts = []
    if canon["tactic"]:
        parts.append(f" --tactic {_compact(canon['tactic'])}")
    elif canon["backend"] != "AUTO":
        parts.append(f" --backend {canon['backend']}")
    if canon["eplb"]:
        parts.append(" --eplb")
    if canon["spec_mode"]:
        parts.append(f" --spec-mode {canon['spec_mode']}")
    if canon["draft_tactic"]:
        parts.append(f" --draft-tactic {_compact(canon['draft_tactic'])}")
    elif canon["draft_backend"] is not None:
        parts.append(f" --draft-backend {canon['draft_backend']}")
    return "".join(parts)


def _compact(canonical: str) -> str:
    return ".".join(t for t in canonical.split(".") if t != "*")


def model_generation(
    decls: dict[str, Declaration],
    model: str,
    sm: int | None,
    parallel: str | None,
    selection: Selection | None,
    mode: str,
    out: str | None,
    registry: Registry,
) -> Generation:
    """The outputs of `generate --model M [--sm S] [--parallel P] [selection] [--mode] [--out]`."""
    decl = find_model(model, decls)
    if not decl.family.runtime:
        raise DeclarationError(
            f"{model}: family {decl.family.name} is not built by the runtime (it builds {', '.join(RUNTIME_FAMILIES)}); "
            f"`python -m codegen explain --model {model} --sm <SM>` explains its selection"
        )
    targets = matching_targets(decl, sm, parallel)
    if (sm is not None or parallel is not None) and not targets:
        declared = ", ".join(t.name for t in decl.targets) or "none"
        where = " ".join(x for x in (f"sm_{sm}" if sm is not None else "", f"parallel {parallel}" if parallel else "") if x)
        raise SelectionError(f"{model} declares no target on {where}; its targets: {declared}")
    gen = Generation()
    refusals, explored = [], []
    for target in targets:
        declared = target.selection.selection()
        chosen = selection or declared
        plan, resolution = target_plan(decl, target, chosen)
        if not resolution.claimed:
            refusals.append((target, plan, resolution))
            continue
        if plan.selection == declared.canonical(registry) and out is None:
            continue  # the declared build: part of the declared generation below
        explored.append(plan)
    if refusals and mode == "require":
        lines = [f"{t.name}: refused: {'; '.join(r.refusals)}" for t, _, r in refusals]
        raise NotHonoredError("\n".join(lines) + f"\n--mode require: nothing written (RULES TG5)")
    if refusals:
        root = out or EXPLORE_ROOT
        generic = generic_plan(decl, selection)
        extra = _flags(selection) + (f" --out {out}" if out else "")
        gen.add(root, model_outputs(decl, generic, registry, extra))
        gen.add(root, index_outputs([decl.model.name], explored, f"python -m codegen generate --model {model}{extra}"))
        for target, plan, resolution in refusals:
            gen.messages.append(f"{target.name}: refused: {'; '.join(resolution.refusals)}")
            gen.messages.append(f"  -> generic build: {root}/{decl.model.name}/generic (resolves each layer when it loads)")
        gen.messages.append(
            f"{len(refusals)} target{'s' if len(refusals) != 1 else ''} refused, generic build written. "
            "Use --mode require (MODE=require) to make this an error."
        )
    if explored:
        root = out or EXPLORE_ROOT
        extra = (_flags(selection) if selection else "") + (f" --out {out}" if out else "")
        for plan in explored:
            gen.add(root, build_outputs(decl, plan, registry, extra))
            gen.messages.append(f"{plan.target}: written to {root}/{decl.model.name}/{plan.target}")
        if not refusals:
            gen.add(root, model_outputs(decl, generic_plan(decl), registry, extra))
            gen.add(root, index_outputs([decl.model.name], explored, f"python -m codegen generate --model {model}{extra}"))
    if out is None:
        whole = declared_generation(decls, registry)
        for root, outputs in whole.roots.items():
            gen.add(root, outputs)
    return gen


def apply(gen: Generation, dry_run: bool, base: Path = ROOT) -> list[str]:
    """Write every root (or, with --dry-run, only say what would change); return the lines to print."""
    lines = []
    for root, outputs in gen.roots.items():
        folder = Path(root) if Path(root).is_absolute() else base / root
        if dry_run:
            drift = check_outputs(outputs, folder, scan_orphans=False)
            changing = set(drift.missing) | set(drift.stale)
            for out in outputs:
                lines.append(f"{'would write' if out.path in changing else 'unchanged  '} {root}/{out.path}")
            continue
        for path in write_outputs(outputs, folder):
            lines.append(f"wrote {root}/{path}")
    return lines


def check(decls: dict[str, Declaration], registry: Registry | None = None, base: Path = ROOT) -> tuple[int, str]:
    """Regenerate everything in memory and compare with the tree (GN3): exit code and report."""
    registry = registry or load_registry()
    gen = declared_generation(decls, registry)
    report, dirty = [], False
    for root, outputs in gen.roots.items():
        drift = check_outputs(outputs, base / root, scan_orphans=root != ".")
        prefix = "" if root == "." else f"{root}/"
        for label, items in (("missing", drift.missing), ("stale", drift.stale), ("orphaned", drift.orphaned)):
            for item in items:
                report.append(f"{label}: {prefix}{item}")
        report += drift.diffs
        dirty |= not drift.clean
    if not dirty:
        return 0, "generated files are up to date\n"
    report.append(f"generated files differ from the registry; run `{ALL_COMMAND}` (or `make generate MODEL=<model>`) and commit the result")
    return 1, "\n".join(report) + "\n"

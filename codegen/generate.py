"""`generate` and `check`: which builds a command produces, where they go, and what it says.

Declared builds (a target of a project declaration with its declared selection, every generic build,
the index, the catalog and the schema) go to the repo's `generated/`; a selection that differs from a
target's declared one, or a model declared only through `--models`, is an exploration and goes to
`build/generated/` unless `--out` says otherwise. A target that does not honor the selection is
refused: under `auto` the model's generic build is written instead (planned and headed with the
selection), under `require` nothing is written and the command fails (RULES TG5). A declared target
must claim its own declared selection. Each target is planned once per command: the declared plans
feed the builds, the build index and the exploration alike.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from codegen.files import Output, changed, check_outputs, orphans, remove_orphans, remove_stale_temps, write_verified
from codegen.outputs import ALL_COMMAND, build_outputs, docs_outputs, generic_draft_modes, index_outputs, model_outputs
from codegen.plan import BuildPlan, generic_plan, index_entry, target_plan
from codegen.verify import verify_outputs
from contract import Layout
from families import RUNTIME_FAMILIES
from registry.build_index import Decision, decide
from registry.declarations import MODELS_DIR, Declaration, TargetDecl, find_model, matching_targets
from registry.errors import DeclarationError, NotHonoredError, SelectionError
from registry.impls import Registry, load_registry
from registry.inputs import text_of_path
from registry.model_resolve import ModelResolution
from registry.selection import Selection
from registry.tactics import parse_tactic

ROOT = Path(__file__).resolve().parent.parent
DECLARED_ROOT = "generated"
EXPLORE_ROOT = "build/generated"
DOCS_ROOT = "."


@dataclass
class Generation:
    """Outputs per root folder, the roots whose orphans `generate` removes, and what to tell the user."""

    roots: dict[str, list[Output]] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    prune: set[str] = field(default_factory=set)

    def add(self, root: str, outputs: list[Output]) -> None:
        bucket = self.roots.setdefault(root, [])
        known = {o.path for o in bucket}
        bucket.extend(o for o in outputs if o.path not in known)


def buildable(decls: dict[str, Declaration]) -> list[Declaration]:
    return [d for _, d in sorted(decls.items()) if d.family.runtime]


def project_models(decls: dict[str, Declaration]) -> dict[str, Declaration]:
    """The declarations under registry/models (not a user's `--models` folder): what generated/ holds."""
    names = {p.stem for p in MODELS_DIR.glob("*.toml")}
    return {k: v for k, v in decls.items() if k in names}


@dataclass(frozen=True)
class Planned:
    target: TargetDecl
    plan: BuildPlan
    resolution: ModelResolution


def declared_plans(decls: dict[str, Declaration], registry: Registry | None = None) -> dict[str, tuple[BuildPlan, list[Planned]]]:
    """Every buildable model's generic plan and its targets' plans under their declared selections, resolved
    on `registry` (default: the project's).

    A target must claim its own declared selection: a declared build bound to an implementation its
    target does not honor would be exactly the silent substitution the honored ids exist to prevent
    (RULES TG4).
    """
    out = {}
    for decl in buildable(decls):
        planned = []
        for n, target in enumerate(decl.targets):
            p = Planned(target, *target_plan(decl, target, registry=registry))
            if not p.resolution.claimed:
                raise DeclarationError(
                    f"{_where(decl, n)}: target {target.name} does not claim its own declared selection: "
                    f"{'; '.join(p.resolution.refusals)}; add what it should bind to moe_impls_honored "
                    "(or draft_moe_impls_honored), or declare a selection it honors"
                )
            planned.append(p)
        out[decl.model.name] = (generic_plan(decl), planned)
    return out


def _where(decl: Declaration, n: int) -> str:
    """`registry/models/<model>.toml:<line>: targets[n]` for a project declaration, else the model's name."""
    from registry.toml_lines import line_of

    path = MODELS_DIR / f"{decl.model.name}.toml"
    if not path.is_file():
        return f"{decl.model.name}: targets[{n}]"
    return f"registry/models/{path.name}:{line_of(path.read_text(encoding='utf-8'), ('targets', n))}: targets[{n}]"


def declared_generation(
    decls: dict[str, Declaration],
    registry: Registry,
    root: str = DECLARED_ROOT,
    docs_root: str = DOCS_ROOT,
    plans: dict | None = None,
    only: str | None = None,
    models: Path | None = None,
) -> Generation:
    """Everything `root` (the repo's generated/) and `docs_root` must hold (ARCHITECTURE, "A generated build").

    `only` limits the builds written to one model; the index always covers every model. `models` is
    the `--models` folder the non-project declarations came from, named in their headers (GN2).
    """
    plans = plans if plans is not None else declared_plans(decls, registry)
    project = project_models(decls)
    gen = Generation()
    for name, (generic, targets) in plans.items():
        if only is not None and name != only:
            continue
        decl = decls[name]
        extra = "" if name in project else models_flag(models)
        gen.add(root, model_outputs(decl, generic, registry, extra))
        for planned in targets:
            gen.add(root, build_outputs(decl, planned.plan, registry, extra))
    command = ALL_COMMAND + ("" if set(plans) <= set(project) else models_flag(models))
    gen.add(root, index_outputs(list(plans), [p.plan for _, ts in plans.values() for p in ts], command,
                                generic_draft_modes(decls[n] for n in plans)))
    gen.add(docs_root, docs_outputs(registry))
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


def models_flag(models: Path | None) -> str:
    """` --models DIR` as the user spelled DIR, for a header's Regenerate line (a Python comment: a
    control character in the name could end the comment, so such a name is refused)."""
    if models is None:
        return ""
    text = text_of_path(models)
    if not text.isprintable():
        raise DeclarationError(f"--models {text!r}: a folder name with control characters cannot be written in a build's header; rename it")
    return f" --models {shlex.quote(text)}"


def _compact(canonical: str) -> str:
    """The shortest spelling of a canonical tactic (`torch.*.grouped_gemm.*` -> `torch.grouped_gemm`)."""
    return parse_tactic(canonical, load_registry()).compact


def model_generation(
    decls: dict[str, Declaration],
    model: str,
    sm: int | None,
    parallel: str | None,
    selection: Selection | None,
    mode: str,
    out: str | None,
    registry: Registry,
    dry_run: bool = False,
    models: Path | None = None,
) -> Generation:
    """The outputs of `generate --model M [--sm S] [--parallel P] [selection] [--mode] [--out]`.

    Header commands name the build (model, SM, layout, selection), never where it was written: output
    must not depend on the folder it lands in (ARCHITECTURE: no absolute paths).
    """
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
    project = project_models(decls)
    into_repo = out is None and model in project
    plans = declared_plans(project, registry) if into_repo else {model: (None, [])}
    by_name = {p.target.name: p for p in plans[model][1]}
    gen = Generation()
    refusals, explored = [], []
    for target in targets:
        declared = target.selection.selection()
        same = selection is None or selection.canonical(registry) == declared.canonical(registry)
        planned = by_name.get(target.name) if same else None
        if planned is None:
            planned = Planned(target, *target_plan(decl, target, selection or declared, registry))
        # The build index's decision on the build this command writes (RULES TG6): what is refused here is
        # what `load_model` would refuse.
        decision = decide(index_entry(planned.plan), decl.facts(target.checkpoint), selection or declared, Layout(*planned.plan.layout))
        if not decision.serves:
            refusals.append(decision)
        elif not (same and into_repo):
            explored.append(planned.plan)   # a declared build is written with the declared generation below
    if refusals and mode == "require":
        lines = [_refused(d) for d in refusals]
        raise NotHonoredError("\n".join(lines) + "\n--mode require: nothing written (RULES TG5)")
    root = out or EXPLORE_ROOT
    extra = ("" if model in project else models_flag(models)) + (_flags(selection) if selection else "")
    would = "would be written" if dry_run else "written"
    if refusals:
        gen.add(root, model_outputs(decl, generic_plan(decl, selection), registry, extra))
        for d in refusals:
            gen.messages.append(_refused(d))
            gen.messages.append(f"  -> generic build: {root}/{decl.model.name}/generic (resolves each layer when it loads)")
        count = len(refusals)
        gen.messages.append(
            f"{count} target{'s' if count != 1 else ''} refused, generic build {would}. "
            "Use --mode require (MODE=require) to make this an error."
        )
    if explored:
        for plan in explored:
            gen.add(root, build_outputs(decl, plan, registry, extra))
            gen.messages.append(f"{plan.target}: {would} to {root}/{decl.model.name}/{plan.target}")
        if not refusals:
            gen.add(root, model_outputs(decl, generic_plan(decl), registry, extra))
    if refusals or explored:
        gen.add(root, index_outputs([decl.model.name], explored, f"python -m codegen generate --model {model}{extra}",
                                    generic_draft_modes([decl])))
    if into_repo:
        whole = declared_generation(project, registry, plans=plans, only=model)
        for name, outputs in whole.roots.items():
            gen.add(name, outputs)
    return gen


def _refused(decision: Decision) -> str:
    return f"{decision.target}: refused: {'; '.join(c.text for c in decision.criteria if c.ok is False)}"


def all_generation(decls: dict[str, Declaration], registry: Registry, out: str | None, models: Path | None = None) -> Generation:
    """`generate --all`: the project's declarations into generated/ (pruning orphans), or with --out
    every loaded declaration into OUT, the catalog and schema included under their repo paths."""
    if out is not None:
        return declared_generation(decls, registry, root=out, docs_root=out, models=models)
    project = project_models(decls)
    gen = declared_generation(project, registry)
    gen.prune.add(DECLARED_ROOT)
    extra = sorted({d.model.name for d in buildable(decls)} - set(project))
    if extra:
        gen.messages.append(
            f"note: {', '.join(extra)} (from --models) are not written into generated/, which holds the project's "
            "declarations; pass --out DIR to write them"
        )
    return gen


def write_outputs(outputs: list[Output], root: Path) -> list[str]:
    """Verify, then write each output whose bytes differ from what is on disk; return the paths written.

    Everything is verified before anything is written, so a broken template leaves the tree as it was.
    """
    pending = changed(outputs, root)
    verify_outputs(pending)
    for folder in sorted({(root / o.path).parent for o in outputs}):
        remove_stale_temps(folder, recursive=False)
    return write_verified(pending, root)


def apply(gen: Generation, dry_run: bool, base: Path | None = None) -> list[str]:
    """Verify everything that would change, then write it (or, with --dry-run, say what would change).

    Verification of every root comes before any write, so a broken template leaves every tree as it was.
    """
    base = base if base is not None else ROOT
    folders = {root: Path(root) if Path(root).is_absolute() else base / root for root in gen.roots}
    pending = {root: changed(outputs, folders[root]) for root, outputs in gen.roots.items()}
    verify_outputs([o for outs in pending.values() for o in outs])
    lines = []
    for root, outputs in gen.roots.items():
        prefix = "" if root == DOCS_ROOT else f"{root}/"
        if dry_run:
            changing = {o.path for o in pending[root]}
            lines += [f"{'would write' if o.path in changing else 'unchanged  '} {prefix}{o.path}" for o in outputs]
            if root in gen.prune:
                lines += [f"would remove {prefix}{rel}" for rel in orphans(outputs, folders[root])]
            continue
        for temp in remove_stale_temps(folders[root]):
            lines.append(f"removed {prefix}{temp.relative_to(folders[root]).as_posix()} (left by a write that was killed)")
        lines += [f"wrote {prefix}{path}" for path in write_verified(pending[root], folders[root])]
        if root in gen.prune:
            removed, kept = remove_orphans(outputs, folders[root])
            lines += [f"removed {prefix}{rel} (no declaration produces it)" for rel in removed]
            lines += [f"kept {prefix}{rel}: not generated by moegen, and no declaration produces it; delete it" for rel in kept]
    if not dry_run:
        total = sum(len(o) for o in gen.roots.values())
        written = sum(len(p) for p in pending.values())
        lines.append(f"{written} file{'s' if written != 1 else ''} written, {total - written} unchanged")
    return lines


def check(decls: dict[str, Declaration], registry: Registry | None = None, base: Path | None = None) -> tuple[int, str]:
    """Regenerate the project's declarations in memory and compare with the tree (GN3): exit code, report.

    Missing, stale and orphaned files are listed under their own headings, then the diffs, then the
    command that fixes them.
    """
    registry = registry or load_registry()
    base = base if base is not None else ROOT
    gen = declared_generation(project_models(decls), registry)
    found = {"missing": [], "stale": [], "linked": [], "orphaned": []}
    diffs = []
    for root, outputs in gen.roots.items():
        prefix = "" if root == DOCS_ROOT else f"{root}/"
        drift = check_outputs(outputs, base / root, scan_orphans=root != DOCS_ROOT, label=prefix)
        verify_outputs(drift.pending)   # what generate would write is verified as generate would (GN1, GN4)
        found["missing"] += [prefix + p for p in drift.missing]
        found["stale"] += [prefix + p for p in drift.stale]
        found["linked"] += [prefix + p for p in drift.linked]
        found["orphaned"] += [prefix + p for p in drift.orphaned]
        diffs += drift.diffs
    if not any(found.values()):
        total = sum(len(o) for o in gen.roots.values())
        return 0, f"generated files are up to date ({total} files)\n"
    report = []
    headings = {
        "missing": "missing (declared, not on disk)",
        "stale": "stale (on disk, differs from what the registry generates)",
        "linked": "linked (reached through a symbolic link: a generated file is a regular file in the tree)",
        "orphaned": "orphaned (on disk, no declaration produces it)",
    }
    for kind, paths in found.items():
        if paths:
            report.append(f"{headings[kind]}: {len(paths)}")
            report += [f"  {kind}: {p}" for p in paths]
    report += [d.rstrip("\n") for d in diffs]
    counts = ", ".join(f"{len(v)} {k}" for k, v in found.items() if v)
    report.append(
        f"generated files differ from the registry ({counts}); fix: run `{ALL_COMMAND}` (it rewrites missing and "
        "stale files, replaces links with the files, and removes orphaned ones), then commit the result"
    )
    return 1, "\n".join(report) + "\n"

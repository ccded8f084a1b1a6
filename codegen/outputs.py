"""What a generation writes: the files of each build, of each model, and the shared index, as `Output`s.

Paths are relative to a *generated root* (the repo's `generated/`, `build/generated/` for exploration,
or `--out DIR`); every import inside that root is package-relative, so a root works under any name.
Every Python output carries the claims `codegen.verify` checks before it is written (RULES GN1, GN4):
a build's model files their plan's, the rest the allow-list of constants-only or root-package code.

Each file's header fingerprint covers what its text is rendered from, and nothing else (RULES GN2), so
a change elsewhere in the registry leaves its bytes alone; a file whose text depends on nothing but its
path (a package's `__init__.py`, the root's `__init__.py` and `run.py` shims) carries none.
"""

from __future__ import annotations

import json

from codegen import catalog, schema
from codegen.files import Output
from codegen.headers import MARKER
from codegen.plan import BuildPlan, fingerprint, index_entry
from codegen.render import render_python
from codegen.claims import DATA_CLAIMS, GENERIC_CLAIMS, ROOT_CLAIMS, claims_for_draft, claims_for_modeling
from registry.declarations import Declaration
from registry.impls import Registry


def target_command(plan: BuildPlan, extra: str = "") -> str:
    return f"python -m codegen generate --model {plan.model} --sm {plan.sm} --parallel {plan.parallel}{extra}"


def model_command(model: str, extra: str = "") -> str:
    return f"python -m codegen generate --model {model}{extra}"


ALL_COMMAND = "python -m codegen generate --all"


def _json_output(path: str, payload: dict, command: str) -> Output:
    body = {"$comment": f"{MARKER} Regenerate: {command}. Fingerprint: {fingerprint(payload)}"} | payload
    return Output(path, json.dumps(body, indent=2, sort_keys=True) + "\n")


def _package(path: str, command: str, what: str, docstring: str) -> Output:
    """A package's `__init__.py`: its docstring only, so no fingerprint."""
    return Output(path, render_python("package_init.py.j2", path, command, None, what, docstring=docstring), DATA_CLAIMS)


def build_outputs(decl: Declaration, plan: BuildPlan, registry: Registry, extra: str = "") -> list[Output]:
    """A specialized build: modeling.py, draft.py when it has a draft, resolution.json, __init__.py."""
    from codegen.modeling import render_draft, render_modeling

    base = f"{decl.model.name}/{plan.target}"
    command = target_command(plan, extra)
    out = [
        _package(f"{base}/__init__.py", command, f"Specialized build {plan.target}.", f"Specialized build {plan.target} of {plan.model}."),
        # modeling.py and draft.py: `plan.fingerprint`, the plan's decisions and the bound entries' registry facts.
        Output(f"{base}/modeling.py", render_modeling(decl, plan, registry, command), claims_for_modeling(plan, registry)),
        # resolution.json: the whole report, so it also changes when an implementation becomes an
        # alternative or a rejection of these layers (what `explain` shows).
        _json_output(f"{base}/resolution.json", plan.resolution, command),
    ]
    if plan.draft is not None:
        out.append(Output(f"{base}/draft.py", render_draft(decl, plan, registry, command), claims_for_draft(plan, registry)))
    return out


def generic_draft_modes(decls) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Model -> (kind, speculative modes) of the draft its generic build constructs, for models that have one."""
    from codegen.modeling import generic_draft

    return {d.model.name: (draft.kind, tuple(draft.modes)) for d in decls if (draft := generic_draft(d)) is not None}


def model_outputs(decl: Declaration, generic: BuildPlan, registry: Registry, extra: str = "") -> list[Output]:
    """Per model: its package, its facts (read by the build index and the generic build), its generic build."""
    from codegen.modeling import generic_draft, render_generic, render_generic_draft

    name = decl.model.name
    command = model_command(name, extra)
    quant = {c.name: {"quant_algo": c.quant_algo, "exclude_modules": list(c.exclude_modules),
                      "quantized_layers": sorted([k, v] for k, v in c.quantized_layers.items())} for c in decl.checkpoints}
    profiles = {k: [p.tp, p.moe_tp, p.ep, p.dp] for k, p in decl.parallel_profiles.items()}
    draft_configs = {d.name: d.config for d in decl.drafts}
    # The family an external drafter's config is typed by (the load-time compare reads it); an Eagle3 head's config is no family's.
    draft_families = {d.name: d.family if d.kind == "external" else None for d in decl.drafts}
    # facts.py: exactly the values it writes (the declaration's, never the registry's).
    facts = dict(model=name, family=decl.family.name, config=decl.config, profiles=profiles, quant=quant,
                 facts=generic.facts, draft_configs=draft_configs, draft_families=draft_families)
    return [
        _package(f"{name}/__init__.py", command, f"Builds of {name}.", f"Generated builds of {name}."),
        Output(f"{name}/facts.py", render_python("facts.py.j2", f"{name}/facts.py", command, fingerprint(facts), f"Facts of {name}.", **facts),
               DATA_CLAIMS),
        _package(f"{name}/generic/__init__.py", command, f"Generic build of {name}.", f"Generic build of {name}: resolves each layer when it loads."),
        # generic/modeling.py (and draft.py): `generic.fingerprint`, the generic plan (no resolution: it resolves at load).
        Output(f"{name}/generic/modeling.py", render_generic(decl, generic, registry, command), GENERIC_CLAIMS),
    ] + ([Output(f"{name}/generic/draft.py", render_generic_draft(decl, generic, command), GENERIC_CLAIMS)] if generic_draft(decl) else [])


def index_outputs(models: list[str], plans: list[BuildPlan], command: str = ALL_COMMAND,
                  generic_drafts: dict[str, tuple[str, tuple[str, ...]]] | None = None) -> list[Output]:
    """The root package: the build index of the builds in this root, and the shims of `load_model` and `run`.

    `generic_drafts`: model -> (draft kind, the speculative modes) of its generic build's `draft.py`."""
    drafts = generic_drafts or {}
    targets = [index_entry(p) for p in sorted(plans, key=lambda p: (p.model, p.target))]
    entries = [{"name": m, "generic": f".{m}.generic.modeling", "facts": f".{m}.facts",
                "generic_draft": {"module": f".{m}.generic.draft", "kind": drafts[m][0], "modes": sorted(drafts[m][1])}
                if m in drafts else None}
               for m in sorted(models)]
    return [
        # The index: every entry it lists (changes when what a build binds or honors does).
        Output("_build_index.py", render_python("build_index.py.j2", "_build_index.py", command, fingerprint(entries, targets),
                                                 "The build index of every build in this package.", models=entries, targets=targets),
               DATA_CLAIMS),
        # The shims: their logic is serving's; their text depends on nothing.
        Output("__init__.py", render_python("generated_init.py.j2", "__init__.py", command, None,
                                            "load_model: picks among the builds in this package through the build index (serving.load)."), ROOT_CLAIMS),
        Output("run.py", render_python("run.py.j2", "run.py", command, None,
                                       "The launcher: python -m generated.run (serving.run)."), ROOT_CLAIMS),
    ]


def docs_outputs(registry: Registry) -> list[Output]:
    """The catalog and the schema, at the repo root (RULES GN5)."""
    return [Output(catalog.PATH, catalog.render_catalog(registry)), Output(schema.PATH, schema.render_schema(registry))]

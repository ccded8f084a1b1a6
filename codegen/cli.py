"""The moegen command line: explain, generate, check, list, catalog, schema, import-checkpoint.

Every user error is a `MoegenError`: its message goes to stderr (never a traceback) and the process
exits with its code (2 for bad input or a refusal under `require`; `check` exits 1 on drift).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from registry.errors import MoegenError, NotHonoredError


def _selection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("selection (RULES TA, RQ, DR)")
    group.add_argument("--config", type=Path, help="a deployment selection file (.toml or .json); flags override it")
    group.add_argument("--backend", help="moe_config.backend: AUTO or a backend literal (TORCH, VANILLA, ...)")
    group.add_argument("--tactic", help="moe_config.tactic: pins implementations, e.g. grouped_mm.bf16")
    group.add_argument("--eplb", action="store_true", help="per-layer dynamic EPLB")
    group.add_argument("--spec-mode", help="speculative_config.mode: mtp, eagle3, draft_target, dspark, ngram, prompt_lookup")
    group.add_argument("--draft-backend", help="speculative_config.moe_backend")
    group.add_argument("--draft-tactic", help="speculative_config.moe_tactic")
    group.add_argument("--mode", choices=("auto", "require"), default="auto", help="auto: refused targets fall back to the generic build; require: refusal is an error")


def _selection(args):
    from registry.deploy import from_flags, load_deploy

    base = load_deploy(args.config) if args.config else None
    return from_flags(args.backend, args.tactic, args.eplb, args.spec_mode, args.draft_backend, args.draft_tactic, base).selection()


def _models(args):
    from registry.declarations import load_models

    return load_models(args.models)


def cmd_explain(args) -> int:
    from codegen.explain import explain, render_json, render_text
    from registry.declarations import find_model
    from registry.selection import check_selection

    decl = find_model(args.model, _models(args))
    selection = check_selection(_selection(args))
    explained = explain(decl, args.sm, selection, args.parallel, args.checkpoint)
    text = render_json(decl, args.sm, selection, explained) if args.json else render_text(decl, args.sm, selection, explained, args.mode)
    sys.stdout.write(text)
    declared = [e for e in explained if e.target is not None]
    if args.mode == "require" and not any(e.serves for e in declared):
        # The build index's own reasons (RULES TG6); each already names its target, so several read apart.
        reasons = "; ".join(r for e in declared for r in e.decision.reasons)
        reasons = reasons or f"no target of {args.model} is declared on sm_{args.sm}"
        raise NotHonoredError(f"--mode require: no target serves this selection: {reasons} (RULES TG5, TG6)")
    return 0


def cmd_list(args) -> int:
    decls = _models(args)
    if args.names:
        print(" ".join(sorted(decls)))
        return 0
    for name, decl in sorted(decls.items()):
        print(f"{name}  ({decl.family.name}{'' if decl.family.runtime else ', explain only'})  {decl.model.doc}")
        for t in decl.targets:
            print(f"    {t.name}")
    return 0


def cmd_generate(args) -> int:
    from codegen.generate import all_generation, apply, model_generation
    from registry.impls import load_registry

    registry = load_registry()
    decls = _models(args)
    # A relative --out is relative to where the user runs the command, like any path argument.
    out = str(args.out if args.out.is_absolute() else Path.cwd() / args.out) if args.out else None
    if args.all:
        given = [f for f, v in (("--model", args.model), ("--sm", args.sm), ("--parallel", args.parallel), ("--config", args.config),
                                ("--backend", args.backend), ("--tactic", args.tactic), ("--eplb", args.eplb), ("--spec-mode", args.spec_mode),
                                ("--draft-backend", args.draft_backend), ("--draft-tactic", args.draft_tactic)) if v]
        if given:
            raise MoegenError(f"generate --all writes every declared build with its declared selection; drop {', '.join(given)} "
                              "(or use --model M to explore a selection)")
        gen = all_generation(decls, registry, out, args.models)
    else:
        if not args.model:
            raise MoegenError("generate needs --model M (or --all)")
        explicit = any(v is not None for v in (args.config, args.backend, args.tactic, args.spec_mode, args.draft_backend, args.draft_tactic)) or args.eplb
        selection = _selection(args) if explicit else None
        gen = model_generation(decls, args.model, args.sm, args.parallel, selection, args.mode, out, registry, dry_run=args.dry_run,
                               models=args.models)
    for line in gen.messages:
        print(line)
    for line in apply(gen, args.dry_run):
        print(line)
    return 0


def cmd_check(args) -> int:
    from codegen.generate import check

    code, report = check(_models(args))
    (sys.stdout if code == 0 else sys.stderr).write(report)
    return code


def cmd_catalog(args) -> int:
    from codegen.catalog import PATH, render_catalog
    from codegen.files import Output
    from codegen.generate import ROOT, write_outputs
    from registry.impls import load_registry

    for path in write_outputs([Output(PATH, render_catalog(load_registry()))], ROOT):
        print(f"wrote {path}")
    return 0


def cmd_schema(args) -> int:
    from codegen.files import Output
    from codegen.generate import ROOT, write_outputs
    from codegen.schema import PATH, render_schema
    from registry.impls import load_registry

    for path in write_outputs([Output(PATH, render_schema(load_registry()))], ROOT):
        print(f"wrote {path}")
    return 0


def cmd_import_checkpoint(args) -> int:
    from codegen.import_checkpoint import import_checkpoint

    text, summary = import_checkpoint(args.path, args.name, args.out)
    if args.out is None:
        # TOML is UTF-8 whatever the locale: the bytes go out as such, so a redirect is a valid file.
        sys.stdout.flush()
        if hasattr(sys.stdout, "buffer"):
            sys.stdout.buffer.write(text.encode("utf-8"))
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(text)
    else:
        print(f"wrote {args.out}: {summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m codegen", description="moegen: specialized MoE model builds.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        p.add_argument("--models", type=Path, help="a folder of your own declaration files, besides registry/models")
        p.set_defaults(func=func)
        return p

    p = add("explain", cmd_explain, "Explain how every MoE layer kind of a model resolves on an SM, and which targets claim it.")
    p.add_argument("--model", required=True)
    p.add_argument("--sm", type=int, required=True, help="target SM, e.g. 90 or 100 (no GPU needed)")
    p.add_argument("--parallel", help="parallel layout or profile, e.g. tp16_moetp4ep4")
    p.add_argument("--checkpoint", help="one of the model's checkpoints (default: the matching targets')")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _selection_flags(p)

    p = add("generate", cmd_generate, "Generate the builds of a model (declared ones into generated/, explorations into build/generated/).")
    p.add_argument("--model")
    p.add_argument("--all", action="store_true", help="every declared build, the index, the catalog and the schema")
    p.add_argument("--sm", type=int)
    p.add_argument("--parallel")
    p.add_argument("--out", type=Path, help="write into this folder instead of generated/ or build/generated/ "
                   "(with --all, the catalog and schema land there too, under docs/ and schemas/)")
    p.add_argument("--dry-run", action="store_true", help="list the files and whether they would change; write nothing")
    _selection_flags(p)

    add("check", cmd_check, "Regenerate everything in memory and report missing, stale and orphaned files (exit 1 on drift).")
    add("catalog", cmd_catalog, "Write docs/moe_impl_catalog.md from the registry.")
    add("schema", cmd_schema, "Write schemas/deploy-config.schema.json from the registry.")

    p = add("import-checkpoint", cmd_import_checkpoint, "Write the declaration of a checkpoint folder (no targets).")
    p.add_argument("path", type=Path)
    p.add_argument("--name", help="model name (default: from the folder name)")
    p.add_argument("--out", type=Path, help="the declaration file to write (default: print it)")

    p = add("list", cmd_list, "List the declared models and their targets.")
    p.add_argument("--names", action="store_true", help="model names only, on one line")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Under an ASCII locale a path or name outside ASCII is still printed (escaped), never a crash.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MoegenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

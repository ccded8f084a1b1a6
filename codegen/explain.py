"""`explain`: for each matching target, every MoE layer kind's request, winner and why, as text or JSON.

It replays the same resolution the generator and the generic build run, on any host: the SM is an
argument, nothing probes the machine (RULES TG6, LR5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from registry.declarations import Declaration, TargetDecl, matching_targets, resolve_target
from registry.model import NON_NEURAL_MODES
from registry.model_resolve import ANY, ROLE_NAMES, ModelResolution, resolve_model, span
from registry.resolve import LayerReport
from registry.selection import Selection


@dataclass(frozen=True)
class Explained:
    """One explained site: a declared target, or the generic build where no target matches."""

    name: str
    target: TargetDecl | None
    parallel: str
    resolution: ModelResolution


def explain(decl: Declaration, sm: int, selection: Selection, parallel: str | None = None, checkpoint: str | None = None) -> list[Explained]:
    targets = matching_targets(decl, sm, parallel, checkpoint)
    if targets:
        return [Explained(t.name, t, t.parallel, resolve_target(decl, t, selection)) for t in targets]
    layout = decl.layout(parallel) if parallel else None
    ckpt = checkpoint or decl.checkpoints[0].name
    resolution = resolve_model(
        decl.facts(ckpt), selection, sm=sm, moe_tp=layout.moe_tp if layout else 1, ep=layout.ep if layout else 1
    )
    return [Explained(f"{decl.model.name}/generic", None, parallel or "tp1", resolution)]


def _honors(value, what: str) -> str:
    if value is None:
        return f"no {what} tactic (no {what} ids declared)"
    if value == ANY:
        return f"any {what} id"
    return f"{len(value)} {what} id{'s' if len(value) != 1 else ''}"


def _selection_text(selection: Selection) -> str:
    parts = [f"moe_config.tactic {selection.tactic!r}" if selection.tactic else f"moe_config.backend {selection.backend!r}"]
    if selection.eplb:
        parts.append("dynamic EPLB")
    if selection.spec_mode:
        parts.append(f"speculative_config.mode {selection.spec_mode!r}")
        if selection.draft_tactic:
            parts.append(f"speculative_config.moe_tactic {selection.draft_tactic!r}")
        elif selection.draft_backend:
            parts.append(f"speculative_config.moe_backend {selection.draft_backend!r}")
    return ", ".join(parts)


def _report_lines(report: LayerReport) -> list[str]:
    kind = ROLE_NAMES[report.role]
    lines = [
        f"  {kind} layers {span(report.layers)}: checkpoint {report.checkpoint_format} ({report.format_source}), "
        f"runs {report.run_format} ({report.run_format_source})",
        f"    request {report.requested} ({report.field})",
        f"    -> {report.winner}  {report.family}, {report.selected_by}",
        f"       also eligible: {', '.join(report.alternatives) or 'none'}",
    ]
    if report.rejections:
        lines.append(f"       turned down:   {report.rejections[0].describe()}")
        lines += [f"                      {r.describe()}" for r in report.rejections[1:]]
    lines += [f"    warning: {w}" for w in report.warnings]
    return lines


def _draft_build_line(decl: Declaration, site: Explained, mode: str) -> str:
    """Which draft build serves the selection's speculative mode at this site (RULES TG6)."""
    # Resolution already refused a mode no declared draft serves.
    draft = next(d for d in decl.drafts if mode in d.modes)
    if site.target is None:
        from codegen.modeling import generic_draft

        if generic_draft(decl) is draft:
            return f"  draft build: generated/{decl.model.name}/generic/draft.py ({draft.kind} {draft.name}, resolved at load)"
        return (f"  draft build: none (generic builds construct only the embedded or replacement-head MTP drafts of "
                f"deepseek_v3 and glm4_moe; the {draft.kind} draft {draft.name} is declared)")
    built = site.target.selection.spec_mode
    if built == mode:
        return f"  draft build: generated/{decl.model.name}/{site.target.name}/draft.py ({draft.kind} {draft.name})"
    holds = f"the draft of speculative mode {built}" if built else "no draft"
    return f"  draft build: none (target {site.target.name} was generated with {holds}, not {mode})"


def render_text(decl: Declaration, sm: int, selection: Selection, explained: list[Explained], mode: str) -> str:
    family = decl.family
    moe = set(family.moe_layers(decl.config))
    dense = tuple(i for i in range(decl.config["num_hidden_layers"]) if i not in moe)
    out = [f"{decl.model.name} (family {family.name}) on sm_{sm}", f"selection: {_selection_text(selection)}"]
    for site in explained:
        r = site.resolution
        out.append("")
        if site.target is None:
            where = f"no declared target on sm_{sm}{' with parallel ' + site.parallel if site.parallel else ''}"
            if decl.family.runtime:
                out.append(f"{site.name}: {where}; the generic build resolves checkpoint {r.checkpoint} as follows")
            else:
                out.append(f"{site.name}: {where}; family {decl.family.name} is explain-only (the runtime does not "
                           f"build it), so checkpoint {r.checkpoint} resolves as follows")
        else:
            t = site.target
            verdict = "claims this selection" if r.claimed else "refuses this selection"
            out.append(f"target {t.name} (honors {_honors(t.moe_impls_honored, 'target')}, {_honors(t.draft_moe_impls_honored, 'draft')}): {verdict}")
            for refusal in r.refusals:
                out.append(f"  refused: {refusal}")
            if not r.claimed:
                serve = "fails (mode require)" if mode == "require" else f"the generic build generated/{decl.model.name}/generic serves instead"
                out.append(f"  -> {serve} (RULES TG5)")
        for report in r.reports:
            out += _report_lines(report)
        if dense:
            out.append(f"  dense layers {span(dense)}: no MoE")
        if selection.spec_mode and selection.spec_mode not in NON_NEURAL_MODES:
            out.append(_draft_build_line(decl, site, selection.spec_mode))
        if not selection.spec_mode and decl.drafts:
            modes = sorted({m for d in decl.drafts for m in d.modes})
            out.append(f"  draft layers: not selected (no speculative_config.mode; this model's drafts serve {', '.join(modes)})")
        out += [f"  note: {n}" for n in r.notes]
    return "\n".join(out) + "\n"


def render_json(decl: Declaration, sm: int, selection: Selection, explained: list[Explained]) -> str:
    payload = {
        "model": decl.model.name,
        "family": decl.family.name,
        "sm": sm,
        "selection": selection.canonical(),
        "sites": [
            {
                "name": s.name,
                "target": s.target is not None,
                "parallel": s.parallel,
                "checkpoint": s.resolution.checkpoint,
                "claimed": s.resolution.claimed,
                "refusals": list(s.resolution.refusals),
                "notes": list(s.resolution.notes),
                "warnings": list(s.resolution.warnings),
                "layers": [r.to_dict() for r in s.resolution.reports],
            }
            for s in explained
        ],
    }
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"

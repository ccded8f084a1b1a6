"""`explain`: for each matching target, whether its build serves the selection and every MoE layer
kind's request, winner and why, as text or JSON.

It replays the build index's own decision (`registry.build_index.decide`, on the index entry the generator
writes for the target) and the resolution the generic build runs, on any host: the SM is an
argument, nothing probes the machine (RULES TG6, LR5). What it says serves is what `load_model` loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from codegen.plan import index_entry, target_plan
from contract import ANY, ROLE_NAMES
from registry.build_index import Decision, bound_layers, decide
from registry.declarations import Declaration, TargetDecl, matching_targets
from registry.model import NON_NEURAL_MODES
from registry.layer_task import span
from registry.model_resolve import ModelResolution, resolve_model
from registry.resolve import LayerReport
from registry.selection import Selection


@dataclass(frozen=True)
class Explained:
    """One explained site: a declared target, or the generic build where no target matches."""

    model: str
    name: str
    target: TargetDecl | None
    parallel: str
    resolution: ModelResolution   # the target's claim (its honored ids), or the generic build's
    decision: Decision | None     # the build index's decision for the target; None without one
    generic: ModelResolution | None = None   # what the generic build binds when the target does not serve
    generic_draft: bool = False   # the generic build constructs the draft of the selection's mode

    @property
    def serves(self) -> bool:
        return self.decision is None or self.decision.serves

    @property
    def loads(self) -> str:
        """What `load_model` loads here under mode auto."""
        return self.name if self.target is not None and self.serves else f"{self.model}/generic"

    @property
    def loaded(self) -> ModelResolution:
        return self.resolution if self.generic is None else self.generic

    @property
    def loaded_bound(self) -> tuple:
        """(role, layers, id) that the loaded build binds: a generic build holds a draft only where it
        constructs one for the selection's mode (RULES SD3)."""
        drops = (self.target is None or not self.serves) and not self.generic_draft
        return tuple(b for b in bound_layers(self.loaded) if not (drops and b[0] == "draft"))


def explain(decl: Declaration, sm: int, selection: Selection, parallel: str | None = None, checkpoint: str | None = None) -> list[Explained]:
    held = _generic_holds_draft(decl, selection.spec_mode)
    targets = matching_targets(decl, sm, parallel, checkpoint)
    if targets:
        return [replace(_target_site(decl, t, selection), generic_draft=held) for t in targets]
    layout = decl.layout(parallel) if parallel else None
    ckpt = checkpoint or decl.checkpoints[0].name
    resolution = resolve_model(
        decl.facts(ckpt), selection, sm=sm, moe_tp=layout.moe_tp if layout else 1, ep=layout.ep if layout else 1
    )
    return [Explained(decl.model.name, f"{decl.model.name}/generic", None, parallel or "tp1", resolution, None, None, held)]


def _generic_holds_draft(decl: Declaration, mode: str | None) -> bool:
    """Whether the model's generic build constructs the draft of speculative `mode` (generic/draft.py)."""
    from codegen.modeling import generic_draft

    draft = generic_draft(decl)
    return mode is not None and draft is not None and mode in draft.modes


def _target_site(decl: Declaration, target: TargetDecl, selection: Selection) -> Explained:
    """The build index's decision on the index entry the generator writes for this target's declared build."""
    layout = decl.layout(target.parallel)
    facts = decl.facts(target.checkpoint)
    decision = decide(index_entry(target_plan(decl, target)[0]), facts, selection, layout)
    generic = None if decision.serves else resolve_model(facts, selection, target.sm, layout.moe_tp, layout.ep)
    return Explained(decl.model.name, target.name, target, target.parallel, decision.resolution, decision, generic)


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
        f"    -> {report.winner}  {report.backend}, {report.selected_by}",
        f"       weights: {report.weights}",
        f"       {report.verification}",
        f"       also eligible: {', '.join(report.alternatives) or 'none'}",
    ]
    if report.rejections:
        lines.append(f"       turned down:   {report.rejections[0].describe()}")
        lines += [f"                      {r.describe()}" for r in report.rejections[1:]]
    lines += [f"    warning: {w}" for w in report.warnings]
    return lines


def _draft_build_line(decl: Declaration, site: Explained, mode: str) -> str:
    """Which draft build serves the selection's speculative mode at this site (RULES TG6): the serving
    target's draft.py, or else what the generic build that loads instead constructs."""
    # Resolution already refused a mode no declared draft serves.
    draft = next(d for d in decl.drafts if mode in d.modes)
    if site.target is not None and site.serves:
        return f"  draft build: generated/{decl.model.name}/{site.target.name}/draft.py ({draft.kind} {draft.name})"
    why = ""
    if site.target is not None:
        built = site.target.selection.spec_mode
        holds = f"the draft of speculative mode {built}" if built else "no draft"
        why = (f"target {site.target.name} was generated with {holds}, not {mode}; " if built != mode
               else f"target {site.target.name} does not serve (criteria above); ")
    if site.generic_draft:
        return f"  draft build: {why}generated/{decl.model.name}/generic/draft.py ({draft.kind} {draft.name}, resolved at load)"
    from codegen.modeling import mtp_families, stages_families

    # A family that refuses its embedded MTP says why (its checkpoints hold nothing for the draft to load).
    refusal = f"; {decl.family.mtp_refusal}" if draft.kind == "embedded_mtp" and decl.family.mtp_refusal else ""
    return (f"  draft build: none ({why}generic builds construct only the embedded or replacement-head MTP drafts of "
            f"{mtp_families()} and the draft stages of {stages_families()}; the {draft.kind} draft {draft.name} is "
            f"declared{refusal})")


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
            verdict = "serves this selection" if site.serves else "does not serve this selection"
            out.append(f"target {t.name} (honors {_honors(t.moe_impls_honored, 'target')}, {_honors(t.draft_moe_impls_honored, 'draft')}): {verdict} (RULES TG6)")
            for c in site.decision.criteria:
                out.append(f"  {c.name}: {'yes' if c.ok else 'no' if c.ok is False else '-'}: {c.text}")
            if site.serves:
                out.append(f"  -> load_model loads {t.name}")
            elif mode == "require":
                out.append("  -> fails (mode require) (RULES TG5)")
            else:
                out.append(f"  -> the generic build generated/{decl.model.name}/generic serves instead (RULES TG5); it binds:")
        shown = r if mode == "require" else site.loaded
        generic_loads = site.target is None or (not site.serves and mode != "require")
        # A generic build holds a draft only where it constructs one (RULES SD3); otherwise its draft
        # layers are narrated only where the family is explain-only, as what the selection resolves to.
        skip_draft = generic_loads and decl.family.runtime and not site.generic_draft
        for report in shown.reports:
            if not (skip_draft and report.role == "draft"):
                out += _report_lines(report)
        if dense:
            out.append(f"  dense layers {span(dense)}: no MoE")
        if selection.spec_mode and selection.spec_mode not in NON_NEURAL_MODES:
            out.append(_draft_build_line(decl, site, selection.spec_mode))
        if not selection.spec_mode and decl.drafts:
            modes = sorted({m for d in decl.drafts for m in d.modes})
            out.append(f"  draft layers: not selected (no speculative_config.mode; this model's drafts serve {', '.join(modes)})")
        out += [f"  note: {n}" for n in shown.notes]
        if skip_draft and selection.spec_mode and selection.spec_mode not in NON_NEURAL_MODES:
            out.append("  note: the generic build holds no draft: it decodes without one (RULES SD3)")

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
                "serves": s.serves,
                "criteria": [{"name": c.name, "ok": c.ok, "text": c.text} for c in s.decision.criteria] if s.decision else [],
                "loads": s.loads,
                "loaded": [{"role": role, "layers": list(layers), "impl": impl} for role, layers, impl in s.loaded_bound],
                "notes": list(s.resolution.notes),
                "warnings": list(s.resolution.warnings),
                "layers": [r.to_dict() for r in s.resolution.reports],
            }
            for s in explained
        ],
    }
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"

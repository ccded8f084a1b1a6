"""A model as the selection rules see it: its MoE layers, their formats, its drafts (pure data).

Built from a validated declaration (`registry.declarations`) or, in a generic build, from the
literal tables the generator inlined (`facts_to_literal` writes them, `facts_from_literal` reads them
back), so resolution at load needs neither pydantic nor the files; `layout_of` reads the model's
parallel names.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import ContractError, Layout, MoeShape, parse_layout
from registry.errors import SelectionError
from registry.formats import LayerFormat

SPEC_MODES = ("mtp", "eagle3", "draft_target", "dspark", "ngram", "prompt_lookup")
NON_NEURAL_MODES = ("ngram", "prompt_lookup")
DRAFT_KINDS = ("embedded_mtp", "replacement_mtp", "external", "eagle3", "draft_stages")
# Drafts whose MoE layers live in the target's weights register into its load balancer (DR6).
BALANCED_DRAFT_KINDS = ("embedded_mtp", "draft_stages")
# Drafts whose tensors live in the target's own checkpoint folder (every other kind has a folder of its own).
EMBEDDED_DRAFT_KINDS = ("embedded_mtp", "draft_stages")


@dataclass(frozen=True)
class MoeSite:
    """One MoE layer: its index, the experts' module path and its checkpoint format (FN1)."""

    layer: int
    module: str
    format: LayerFormat


@dataclass(frozen=True)
class DraftFacts:
    name: str
    kind: str
    modes: tuple[str, ...]
    sites: tuple[MoeSite, ...]
    shape: MoeShape | None
    vanilla_with_target: bool = False   # DR5

    @property
    def registers_into_target_balancer(self) -> bool:
        return self.kind in BALANCED_DRAFT_KINDS


@dataclass(frozen=True)
class ModelFacts:
    model: str
    family: str
    checkpoint: str
    shape: MoeShape
    sites: tuple[MoeSite, ...]
    excluded_layers: str = "tactic"     # FN5: "tactic" or "backend"
    drafts: tuple[DraftFacts, ...] = ()

    def draft_for(self, mode: str) -> DraftFacts | None:
        return next((d for d in self.drafts if mode in d.modes), None)


def layout_of(parallel: str, profiles: dict[str, Layout]) -> Layout:
    """The layout a parallel name stands for in a model with these declared profiles (contract.parse_layout);
    a name that is none is the user's to fix, a `SelectionError`."""
    try:
        return parse_layout(parallel, profiles)
    except ContractError as exc:
        raise SelectionError(str(exc)) from None


# The MoeShape fields a facts literal holds.
_RESOLVED_SHAPE = ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation", "expert_bias")


def facts_from_literal(data: dict) -> ModelFacts:
    """Rebuild `ModelFacts` from the plain literal a generated `facts.py` holds."""

    def sites(rows):
        return tuple(MoeSite(layer, module, LayerFormat(fmt, source, excluded)) for layer, module, fmt, source, excluded in rows)

    def shape(value):
        return MoeShape(**value) if value is not None else None

    return ModelFacts(
        model=data["model"],
        family=data["family"],
        checkpoint=data["checkpoint"],
        shape=shape(data["shape"]),
        sites=sites(data["sites"]),
        excluded_layers=data["excluded_layers"],
        drafts=tuple(
            DraftFacts(d["name"], d["kind"], tuple(d["modes"]), sites(d["sites"]), shape(d["shape"]), d["vanilla_with_target"])
            for d in data["drafts"]
        ),
    )


def facts_to_literal(facts: ModelFacts) -> dict:
    def sites(items):
        return [[s.layer, s.module, s.format.format, s.format.source, s.format.excluded] for s in items]

    def shape(value):
        # What resolution reads; the swiglu constants are a build's own, inlined from its config.
        return None if value is None else {k: getattr(value, k) for k in _RESOLVED_SHAPE}

    return {
        "model": facts.model,
        "family": facts.family,
        "checkpoint": facts.checkpoint,
        "shape": shape(facts.shape),
        "sites": sites(facts.sites),
        "excluded_layers": facts.excluded_layers,
        "drafts": [
            {"name": d.name, "kind": d.kind, "modes": list(d.modes), "sites": sites(d.sites), "shape": shape(d.shape), "vanilla_with_target": d.vanilla_with_target}
            for d in facts.drafts
        ],
    }

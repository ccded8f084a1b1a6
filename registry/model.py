"""A model as the selection rules see it: its MoE layers, their formats, its drafts (pure data).

Built from a validated declaration (`registry.declarations`) or, in a generic build, from the
literal tables the generator inlined, so resolution at load needs neither pydantic nor the files.
"""

from __future__ import annotations

from dataclasses import dataclass

from registry.families import MoeShape
from registry.formats import LayerFormat

SPEC_MODES = ("mtp", "eagle3", "draft_target", "dspark", "ngram", "prompt_lookup")
NON_NEURAL_MODES = ("ngram", "prompt_lookup")
DRAFT_KINDS = ("embedded_mtp", "replacement_mtp", "external", "eagle3", "draft_stages")
# Drafts whose MoE layers live in the target's weights register into its load balancer (DR6).
BALANCED_DRAFT_KINDS = ("embedded_mtp", "draft_stages")


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

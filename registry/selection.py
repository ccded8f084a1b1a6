"""The deployment's MoE selection as plain data, and the checks that apply before any model loads.

`Selection` is what every consumer reads (the pydantic `MoeConfig`/`SpeculativeConfig` of
`registry.deploy` convert into it). `check_selection` applies TA2, TA4, RQ1 and RQ4 and returns the
stored form: tactics stripped and lowercased.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from registry.errors import SelectionError, TacticError
from registry.impls import AUTO, Registry, load_registry
from registry.model import SPEC_MODES
from registry.resolve import moe_impl_request

TARGET_BACKEND, TARGET_TACTIC = "moe_config.backend", "moe_config.tactic"
DRAFT_BACKEND, DRAFT_TACTIC = "speculative_config.moe_backend", "speculative_config.moe_tactic"


@dataclass(frozen=True)
class Selection:
    backend: str = AUTO
    tactic: str | None = None
    eplb: bool = False
    spec_mode: str | None = None
    draft_backend: str | None = None
    draft_tactic: str | None = None

    def canonical(self, registry: Registry | None = None) -> dict:
        """Equal selections spelled differently give equal dicts (the build fingerprint reads this)."""
        registry = registry or load_registry()
        return {
            "backend": self.backend,
            "tactic": _canonical_tactic(self.tactic, registry, TARGET_TACTIC),
            "eplb": self.eplb,
            "spec_mode": self.spec_mode,
            "draft_backend": self.draft_backend,
            "draft_tactic": _canonical_tactic(self.draft_tactic, registry, DRAFT_TACTIC),
        }


def _canonical_tactic(tactic: str | None, registry: Registry, field: str) -> str | None:
    if tactic is None:
        return None
    return moe_impl_request(tactic, registry=registry, field=field).requested


def check_selection(selection: Selection, registry: Registry | None = None) -> Selection:
    """Refuse, before anything loads, what no model could accept; return the stored form."""
    registry = registry or load_registry()
    backend = selection.backend.strip()
    moe_impl_request(backend, eplb=selection.eplb, registry=registry, field=TARGET_BACKEND)
    tactic = selection.tactic
    if tactic is not None:
        if backend != AUTO:
            raise TacticError(
                f"{TARGET_TACTIC} {tactic.strip().lower()!r} is set next to {TARGET_BACKEND} {backend!r}: "
                f"a tactic is accepted only next to backend AUTO; set {TARGET_BACKEND} to AUTO or drop the tactic (RULES TA4)"
            )
        tactic = moe_impl_request(tactic, eplb=selection.eplb, registry=registry, field=TARGET_TACTIC).tactic.text
    mode = selection.spec_mode
    if mode is not None and mode not in SPEC_MODES:
        raise SelectionError(f"speculative_config.mode {mode!r} is not one of {', '.join(SPEC_MODES)}")
    draft_backend = selection.draft_backend.strip() if selection.draft_backend is not None else None
    draft_tactic = selection.draft_tactic
    if mode is None and (draft_backend is not None or draft_tactic is not None):
        raise SelectionError(
            f"{DRAFT_BACKEND}/{DRAFT_TACTIC} are set but speculative_config.mode is not: "
            "set the speculative mode whose draft they select"
        )
    if draft_backend is not None:
        moe_impl_request(draft_backend, registry=registry, field=DRAFT_BACKEND)
    if draft_tactic is not None:
        if draft_backend not in (None, AUTO):
            raise TacticError(
                f"{DRAFT_TACTIC} {draft_tactic.strip().lower()!r} is set next to {DRAFT_BACKEND} {draft_backend!r}: "
                f"a draft tactic is accepted only next to a {DRAFT_BACKEND} that is unset or AUTO; "
                f"unset {DRAFT_BACKEND} or drop the tactic (RULES TA4)"
            )
        draft_tactic = moe_impl_request(draft_tactic, registry=registry, field=DRAFT_TACTIC).tactic.text
    return replace(selection, backend=backend, tactic=tactic, draft_backend=draft_backend, draft_tactic=draft_tactic)

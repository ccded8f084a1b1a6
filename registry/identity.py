"""Implementation ids: `provider.technique.kernel_name.quant`, parsed and validated (RULES ID1, ID3).

The SM is deliberately not a segment: one id names one implementation whatever GPU it runs on, and
the SMs it supports are eligibility data (ID3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from registry.errors import RegistryError

FIELDS = ("provider", "technique", "kernel_name", "quant")
SEGMENT_RE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*$")


@dataclass(frozen=True, order=True)
class ImplId:
    """One implementation's identity; `str()` gives the canonical dotted text."""

    provider: str
    technique: str
    kernel_name: str
    quant: str

    @classmethod
    def parse(cls, text: str) -> "ImplId":
        """Parse a full id; ids are stored lowercase, so case is folded at this door (ID1)."""
        parts = text.strip().lower().split(".")
        if len(parts) != len(FIELDS):
            raise RegistryError(
                f"implementation id {text!r} has {len(parts)} segments; an id has exactly four: "
                "provider.technique.kernel_name.quant (RULES ID1)"
            )
        for field, part in zip(FIELDS, parts):
            if not SEGMENT_RE.match(part):
                raise RegistryError(
                    f"implementation id {text!r}: {field} segment {part!r} must match "
                    f"{SEGMENT_RE.pattern} (RULES ID1)"
                )
        return cls(*parts)

    def segment(self, field: str) -> str:
        return getattr(self, field)

    def __str__(self) -> str:
        return ".".join((self.provider, self.technique, self.kernel_name, self.quant))

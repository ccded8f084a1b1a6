"""The MoE layer shape's interim home for registry's importers (`families.base.MoeShape`; it moves to `contract.py`).

Architecture families themselves live in `families/` (one folder each; `families.FAMILIES`).
"""

from families.base import MoeShape

__all__ = ["MoeShape"]

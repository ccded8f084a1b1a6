"""Architecture families: one folder each (`families/<name>/spec.py`, and `modeling.py.j2` where the runtime builds it), found here and nowhere else.

A family is its folder: this module lists the folders holding a `spec.py` and imports each one's
`SPEC`, so adding a family edits no table (README "Adding an architecture family"). Stdlib only:
registry and codegen import this, runtime never does.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from families.base import FamilySpec

ROOT = Path(__file__).resolve().parent
TEMPLATE = "modeling.py.j2"   # a runtime family's template, in its folder


def _discover() -> dict[str, FamilySpec]:
    found = {}
    for folder in sorted(p for p in ROOT.iterdir() if (p / "spec.py").is_file()):
        spec = importlib.import_module(f"families.{folder.name}.spec").SPEC
        if spec.name != folder.name:
            raise RuntimeError(f"families/{folder.name}/spec.py describes family {spec.name!r}; a family's folder is its name")
        if spec.runtime != (folder / TEMPLATE).is_file():
            raise RuntimeError(f"families/{folder.name}: runtime={spec.runtime} but {TEMPLATE} is "
                               f"{'absent' if spec.runtime else 'present'}; a family the runtime builds has a template")
        found[spec.name] = spec
    return found


FAMILIES: dict[str, FamilySpec] = _discover()
RUNTIME_FAMILIES = tuple(name for name, spec in FAMILIES.items() if spec.runtime)


def family_for_architecture(architecture: str) -> FamilySpec | None:
    return next((f for f in FAMILIES.values() if architecture in f.architectures), None)


def template_name(family: str) -> str:
    """The jinja name of a family's template (codegen.render's loader searches `families/`)."""
    return f"{family}/{TEMPLATE}"

"""What the registry may import (ARCHITECTURE "Rooms"): never torch, and a pydantic-free core.

Each claim runs in a fresh interpreter, so what this test process already imported cannot hide a
dependency.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CORE = (
    "identity",
    "impls",
    "tactics",
    "resolve",
    "eligibility",
    "formats",
    "model",
    "layer_task",
    "tactic_advice",
    "model_layers",
    "draft_resolve",
    "model_resolve",
    "build_index",
    "generic",
    "selection",
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_importing_every_registry_module_and_codegen_explain_imports_no_torch():
    # RULES TG6: explain runs on a host without the GPU (ARCHITECTURE: registry/codegen never import torch)
    result = run(
        """
        import importlib, pkgutil, sys
        import registry
        for module in pkgutil.iter_modules(registry.__path__):
            importlib.import_module("registry." + module.name)
        import codegen.explain, codegen.cli
        from registry.declarations import load_models
        load_models()
        heavy = sorted(m for m in ("torch", "jinja2", "libcst", "numpy") if m in sys.modules)
        print(heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_pure_core_imports_and_resolves_with_pydantic_blocked():
    # RULES GN1: the generic build resolves through the same code at load
    # A generic build resolves its layers at load where pydantic may be absent.
    result = run(
        f"""
        import sys
        sys.modules["pydantic"] = None  # any `import pydantic` now raises ImportError
        import contract, families  # the value types and the family specs the core reads
        for name in {CORE!r}:
            __import__("registry." + name)
        from registry.model_resolve import resolve_model
        from registry.model import ModelFacts, MoeSite
        from registry.formats import LayerFormat
        from contract import MoeShape
        from registry.selection import Selection
        facts = ModelFacts("m", "mixtral", "m_bf16", MoeShape(64, 128, 4, 2, "silu_glu", False),
                           (MoeSite(0, "model.layers.0.block_sparse_moe.experts", LayerFormat("bf16", "x", False)),))
        print(resolve_model(facts, Selection(tactic="eager.bf16"), sm=90).reports[0].winner)
        print("pydantic" in sys.modules and sys.modules["pydantic"] is not None)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch.eager.loop.bf16", "False"]


def test_the_pydantic_guard_really_blocks_pydantic():
    # RULES GN1 (control for the test above)
    # the guard above would prove nothing if blocking did not make the typed modules fail
    result = run(
        """
        import sys
        sys.modules["pydantic"] = None
        import registry.deploy
        """
    )
    assert result.returncode != 0 and "import of pydantic halted" in result.stderr

"""Triton kernels imported on first use, so that the modules which launch them import on hosts without Triton."""
from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def triton_kernels(module: str, *names: str) -> tuple | None:
    """(the `triton` package, then `module`'s kernels `names`), or None where Triton is not installed."""
    try:
        import triton

        found = importlib.import_module(module)
    except ImportError:
        return None
    return (triton, *(getattr(found, name) for name in names))

"""Shared by the Triton interpreter tests: `tl.dot` on bf16 operands computed as the GPU computes it."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def bf16_dot(monkeypatch):
    """The interpreter (Triton 3.9) multiplies bf16 `tl.dot` operands as their uint16 storage. Upcast them first:
    exact, and what the GPU's bf16 MMA with fp32 accumulation computes. Import it into a test module to use it."""
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def upcast(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: dot(self, upcast(a), upcast(b), *rest))

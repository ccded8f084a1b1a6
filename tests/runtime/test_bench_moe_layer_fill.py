"""bench/moe_layer.py's random weights on the CPU: every registered format's module, built as the bench builds it,
gets valid codes and realistic scales in each buffer, the same for the same seed, so a GPU run spends no device
time on a bench that cannot fill its modules."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_layer  # noqa: E402  (bench/moe_layer.py)
from runtime.experts.base import MoeShape  # noqa: E402

TINY = MoeShape(256, 128, 4, 2, "silu_glu")


def _filled(cls, seed):
    module = cls(TINY, device="meta").to_empty(device="cpu")
    for _, buf in module.named_buffers():
        buf.zero_()
    moe_layer.fill_module(module, seed)
    return module


@pytest.mark.parametrize("fmt", sorted(moe_layer.CUPY_CLASSES))
def test_every_format_gets_valid_random_contents_in_each_buffer(fmt):
    module = _filled(moe_layer.CUPY_CLASSES[fmt], 100)
    assert module.weights_loaded
    buffers = dict(module.named_buffers())
    assert buffers
    for name, buf in buffers.items():
        if buf.dtype == torch.uint8:
            values = buf.int()
            if name.startswith("s"):   # E8M0 exponent bytes near 2^-8
                assert 115 <= int(values.min()) and int(values.max()) <= 123, name
            else:                      # two E2M1 codes a byte: both nibbles take many values
                assert len(torch.unique(values & 15)) > 8 and len(torch.unique(values >> 4)) > 8, name
            continue
        values = buf.float()
        assert torch.isfinite(values).all(), name
        assert len(torch.unique(values)) > min(8, buf.numel() // 2), name
        if buf.dtype == torch.float32:
            assert 1e-4 <= float(values.min()) and float(values.max()) <= 3e-4, name
        elif buf.dtype == torch.bfloat16:
            assert 0.015 < float(values.std()) < 0.025, name
        elif buf.dtype == torch.float8_e4m3fn and name.startswith("s"):
            assert 0.5 <= float(values.min()) and float(values.max()) <= 4, name
        else:
            assert float(values.abs().max()) <= 448, name


def test_the_same_seed_fills_the_same_bits_and_another_seed_others():
    cls = moe_layer.CUPY_CLASSES["fp8_block_scales"]
    first, again, other = (dict(_filled(cls, seed).named_buffers()) for seed in (100, 100, 101))
    for name, buf in first.items():
        assert torch.equal(buf.view(torch.uint8), again[name].view(torch.uint8)), name
        assert not torch.equal(buf.view(torch.uint8), other[name].view(torch.uint8)), name

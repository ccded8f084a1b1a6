"""A 4-bit TORCH layer on a CUDA GPU keeps its weights packed: held bytes, peak memory of a forward
within 1.1x (packed bytes + activations), and the same result as the bf16 layer on the weights it
holds (tests/runtime/test_experts_packed.py is the CPU twin, measured by torch's allocation events).

Memory is torch's CUDA allocator statistics (memory_allocated, max_memory_allocated: every block
the caching allocator hands out, rounded to its 512-byte granularity). "Activations" is measured as
on the CPU: the peak the bf16 TORCH layer's forward needs above its own weights, same inputs.
Tolerance against the bf16 layer: equal up to the GPU GEMM's reduction order per output chunk
(RMS 1e-3, max 2^-7 relative), since cuBLAS may tile a chunk of 8 columns differently from 1024.

Run on a GPU host from the repository root: python -m pytest tests/gpu/test_packed_experts_memory.py -q
"""
import pytest
import torch

from runtime.experts.base import ExpertParallel
from tests.gpu.helpers_graphs import allocated_during
from tests.runtime import helpers_memory as mem
from tests.runtime.helpers_experts import assert_rel_close, registry_classes

pytestmark = pytest.mark.gpu

TORCH_4BIT = tuple(c for c in registry_classes("TORCH") if c.FORMAT not in ("bf16", "fp8_block_scales"))


@pytest.mark.parametrize("cls", TORCH_4BIT, ids=lambda c: c.FORMAT)
def test_torch_4bit_layer_peak_memory_on_the_gpu(cls):
    source = mem.packed_source(cls.FORMAT)
    bf16_source = mem.bf16_source(source, cls.FORMAT)
    hidden, ids, weights = mem.inputs("cuda")
    twin, _, twin_held = allocated_during(lambda: mem.bf16_layer(bf16_source, "cuda"))
    twin(hidden, ids, weights)     # first call: cuBLAS workspace and handles, kept by torch
    expected, activations, _ = allocated_during(lambda: twin(hidden, ids, weights))
    del twin

    module, _, held = allocated_during(lambda: cls.from_checkpoint(mem.SPEC, ExpertParallel(), source, "cuda"))
    packed = module.packed_bytes()
    assert packed == sum(t.nbytes for t in source.tensors.values())
    assert packed <= held <= packed + 512 * len(list(module.buffers()))
    assert all(b.device.type == "cuda" and b.dtype != torch.bfloat16 for b in module.buffers())
    module(hidden, ids, weights)
    out, forward_peak, _ = allocated_during(lambda: module(hidden, ids, weights))
    assert_rel_close(out.float().cpu(), expected.float().cpu(), 1e-3, 2.0 ** -7)
    bound = mem.BOUND * (packed + activations)
    print(f"{cls.FORMAT}: packed {packed} B, activations {activations} B, held {held} B, "
          f"forward peak {forward_peak} B: {(held + forward_peak) / (packed + activations):.3f}x")
    assert held + forward_peak <= bound, (held, forward_peak, packed, activations)
    assert twin_held > bound      # the bf16 copy the layer used to hold would not fit: the check can fail

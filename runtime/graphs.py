"""Capturing a decode phase as a CUDA graph: one warm-up outside the capture, with the state it advances restored, then the capture."""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, Sequence

import torch

from runtime.ops.recurrent import leaves


def capture(step: Callable[[], object], state: Sequence[torch.Tensor] = (),
            generator: torch.Generator | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `step()` and what its captured call returned (the buffers every replay rewrites).

    The warm-up runs `step` once on a side stream first (allocator, cuBLAS handles, kernel compilation);
    the tensors in `state` (what a step advances: positions, emitted ids) and `generator` are put back
    afterwards, so the graph starts where the caller was and a seeded run draws the same numbers whether
    or not it captured. The cache slots the warm-up writes are the ones the first replay rewrites.
    """
    saved = [t.clone() for t in state]
    rng = generator.get_state() if generator is not None else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip(state, saved):
        t.copy_(s)
    if rng is not None:
        generator.set_state(rng)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with collector_paused(), torch.cuda.graph(graph):
        out = step()
    return graph, out


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside, as it was after. A capture runs inside: torch collects before
    one only under TORCH_CUDAGRAPH_GC (off by default), and a dead reference cycle holding an older CUDA graph,
    collected mid-capture, destroys that graph, which CUDA refuses while a stream captures; the capture then fails
    ("operation not permitted when stream is capturing (function reset)", then "operation failed due to a previous
    error during capture"). The garbage is collected after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def kernel_counters(size: int, device: torch.device, owner: str) -> torch.Tensor:
    """Zeroed int32 counters a kernel keeps across its launches (each launch's last CTA resets them). Refused
    inside a CUDA-graph capture: there the zero fill would be recorded, not run, so every launch outside
    that graph would start from whatever the memory held and let an early CTA act as the last."""
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{owner} makes its counters at its first call, and that call is inside a CUDA-graph "
                           "capture: call it once before capturing (as runtime.graphs.capture's warm-up does)")
    counters = torch.zeros(size, dtype=torch.int32, device=device)
    _COUNTERS.append((owner, weakref.ref(counters)))
    return counters


# Every set kernel_counters made, with its owner, while it lives (tests/gpu/conftest.py checks they end at zero).
_COUNTERS: list = []


def live_kernel_counters() -> list[tuple[str, torch.Tensor]]:
    """(owner, counters) of every kernel_counters set still alive."""
    live = [(owner, ref, t) for owner, ref in _COUNTERS if (t := ref()) is not None]
    _COUNTERS[:] = [(owner, ref) for owner, ref, _ in live]
    return [(owner, t) for owner, _, t in live]


def advanced_in_place(caches) -> tuple[torch.Tensor, ...]:
    """The tensors of `caches` a step advances from their old value (a recurrent layer's conv and memory
    states), which `capture` must restore after its warm-up; a KV cache is written at the step's position,
    so the first replay rewrites what the warm-up wrote, and it needs nothing. Nested lists are walked (an
    external drafter's caches are a whole model's)."""
    return tuple(t for cache in leaves(caches) for t in getattr(cache, "advanced_in_place", ()))


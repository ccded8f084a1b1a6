"""A capture survives Python's cyclic collector: an older CUDA graph that a dead reference cycle holds is not
destroyed in the middle of the next capture (runtime/graphs.py: `capture` pauses the collector), which CUDA
refuses while a stream captures. Seen in tests/gpu when the speculative tests ran after the router tests in one
process: "operation not permitted when stream is capturing (function reset)", then the capture failed."""
from __future__ import annotations

import gc

import pytest
import torch

from runtime.graphs import capture
from tests.runtime.helpers_gc import eager_collector

pytestmark = pytest.mark.gpu


def test_a_graph_left_in_a_dead_cycle_during_a_capture_waits_for_the_collector():
    x = torch.randn(256, device="cuda")
    held = [capture(lambda: x * 2)[0]]

    def step():
        if torch.cuda.is_current_stream_capturing() and held:
            cycle = {"graph": held.pop()}
            cycle["self"] = cycle   # the older graph's last reference, in a dead cycle now
            del cycle
            [[] for _ in range(1000)]   # allocations past the thresholds: the collector runs here unless paused
        return x + 1

    with eager_collector():
        graph, out = capture(step)
    assert not held
    gc.collect()   # the older graph goes now, outside any capture
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x + 1)

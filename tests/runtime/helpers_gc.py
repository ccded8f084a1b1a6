"""Python's cyclic collector at its most eager, for the CPU test of `runtime.graphs.collector_paused` and the GPU
capture test (tests/gpu/test_graph_capture.py)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def eager_collector():
    """Thresholds of 1 inside, and the process's older objects frozen out of the collector's view (the collection
    after the freeze resets its count of long-lived objects, which else holds off full collections for ~1/4 of
    them), so a dead cycle made inside is freed within a few allocations, unless the collector is off."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()

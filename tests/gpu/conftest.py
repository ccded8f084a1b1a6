"""Checks every GPU test gets: it leaves the router kernel's per-token arrival counters at zero.

A counter left above zero makes an early CTA of that token's next launch act as its last: it takes the top-k
before the other CTAs' logits are in, in every later call of the process, with no error. So the test that
leaves one fails here, not a later test with slightly wrong routing.
"""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _router_counters_end_at_zero():
    yield
    from runtime.kernels import router

    for device, counters in router._COUNTERS.items():
        left = counters.cpu()   # waits for the test's launches
        if left.any():
            counters.zero_()   # later tests start clean
            pytest.fail(f"the router kernel's counters on {device} were left at {left.tolist()} "
                        "(each launch's last CTA resets its token's counter to 0)")

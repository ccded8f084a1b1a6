"""Checks every GPU test gets: it leaves every kernel's arrival counters at zero (the router's per token, the
multi-CTA sort's ticket: runtime.graphs.kernel_counters).

A counter left above zero makes an early CTA of that kernel's next launch act as its last: it takes the top-k
before the other CTAs' logits are in, or scans counts not yet written, in every later call of the process,
with no error. So the test that leaves one fails here, not a later test with slightly wrong numbers.
"""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _kernel_counters_end_at_zero():
    yield
    from runtime.graphs import live_kernel_counters

    for owner, counters in live_kernel_counters():
        left = counters.cpu()   # waits for the test's launches
        if left.any():
            counters.zero_()   # later tests start clean
            pytest.fail(f"{owner}'s counters on {counters.device} were left at {left.tolist()} "
                        "(each launch's last CTA resets its own to 0)")

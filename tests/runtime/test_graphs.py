"""runtime/graphs.py's `collector_paused`, inside which `capture` captures: Python's cyclic collector frees no dead
cycle inside it (one holding an older CUDA graph would destroy that graph mid-capture), and is as it was after."""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from runtime.graphs import collector_paused


class _Node:
    pass


def _dead_cycle_freed_inside(context) -> tuple[bool, bool]:
    """(freed inside `context`, freed after a collection) of a dead cycle made inside it, with the collector at
    its most eager: thresholds of 1, and the process's older objects frozen out of its view (the collection after
    the freeze resets the count of long-lived objects, which else holds off full collections for ~1/4 of them)."""
    freed = []
    threshold = gc.get_threshold()
    gc.freeze()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        with context:
            node = _Node()
            node.self = node
            weakref.finalize(node, freed.append, True)
            del node
            [[] for _ in range(1000)]
            inside = bool(freed)
        gc.collect()
        return inside, bool(freed)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def test_no_dead_cycle_is_freed_inside_and_the_collector_frees_it_after():
    assert _dead_cycle_freed_inside(contextlib.nullcontext()) == (True, True)   # the check sees the collector run
    assert _dead_cycle_freed_inside(collector_paused()) == (False, True)


def test_the_collector_is_back_on_after_and_after_an_error():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()

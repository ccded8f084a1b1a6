"""runtime/graphs.py's `collector_paused`, inside which `capture` captures: Python's cyclic collector frees no dead
cycle inside it (one holding an older CUDA graph would destroy that graph mid-capture), and is as it was after."""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from runtime.graphs import collector_paused
from tests.runtime.helpers_gc import eager_collector


class _Node:
    pass


def _dead_cycle_freed_inside(context) -> tuple[bool, bool]:
    """(freed inside `context`, freed after a collection) of a dead cycle made inside it, under the most eager
    collector."""
    freed = []
    with eager_collector():
        with context:
            node = _Node()
            node.self = node
            weakref.finalize(node, freed.append, True)
            del node
            [[] for _ in range(1000)]
            inside = bool(freed)
        gc.collect()
    return inside, bool(freed)


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

"""Paced garbage collection: automatic passes off, cyclic garbage still collected on the timer."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from turbine.runtime.gc_pacing import pace_garbage_collection


class Node:
    pass


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()
    gc.enable()


async def test_automatic_collection_is_off_and_the_timer_collects_cycles(restore_gc):
    task = pace_garbage_collection(0.05)
    assert not gc.isenabled()
    node = Node()
    node.me = node  # a cycle: only the collector can free it
    alive = weakref.ref(node)
    del node
    for _ in range(100):
        if alive() is None:
            break
        await asyncio.sleep(0.01)
    assert alive() is None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.isenabled()  # stopping the pacing hands collection back to Python


async def test_the_interval_must_be_positive(restore_gc):
    with pytest.raises(ValueError, match="interval_s"):
        pace_garbage_collection(0)
    assert gc.isenabled()

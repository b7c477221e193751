"""The kvbm connector's consolidated stream for the router, without an engine: the scheduler half's mirror
of the worker's per-tier events becomes vLLM KV events (take_events), which the relay turns into Turbine
events with a tier, which the router's index follows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_events")

from turbine.router.indexer import KvIndexer, WorkerKey  # noqa: E402
from turbine.vllm.kv_events_relay import translate  # noqa: E402
from turbine.vllm.kvbm_connector import KvbmWorkerMetadata, TurbineKvbmConnector  # noqa: E402

BS = 16
W = WorkerKey("w")


def scheduler_half() -> TurbineKvbmConnector:
    """The scheduler half's event state alone (the constructor needs a whole vLLM config)."""
    c = TurbineKvbmConnector.__new__(TurbineKvbmConnector)
    c.block_size, c._where, c._events, c._in_flight, c._tracked = BS, {}, [], {}, {}
    return c


def step(c: TurbineKvbmConnector, *events: tuple[bool, str, int]) -> list[tuple[str, str, list[int]]]:
    """One engine step's worker events in; what the connector publishes out, as (kind, medium, hashes)."""
    c.update_connector_output(SimpleNamespace(invalid_block_ids=set(),
                                              kv_connector_worker_meta=KvbmWorkerMetadata(list(events))))
    return [(type(e).__name__, e.medium, list(e.block_hashes)) for e in c.take_events()]


def test_own_tiers_are_one_stream_and_the_shared_tier_is_apart():
    c = scheduler_half()
    # Offloaded: written through host, disk and shared in one step.
    out = step(c, (True, "host", 1), (True, "disk", 1), (True, "shared", 1), (True, "host", 2), (True, "disk", 2))
    assert out == [("BlockStored", "turbine.kvbm/host", [1]), ("BlockStored", "turbine.kvbm/shared", [1]),
                   ("BlockStored", "turbine.kvbm/host", [2])]
    # Out of host memory, still on disk: stored again with its new fastest tier (runs become one event).
    assert step(c, (False, "host", 1), (False, "host", 2)) == [("BlockStored", "turbine.kvbm/disk", [1, 2])]
    # Gone from disk too: removed from the worker's own tiers; block 1 is still in the shared tier.
    assert step(c, (False, "disk", 1), (False, "disk", 2)) == [("BlockRemoved", "turbine.kvbm/disk", [1, 2])]
    assert step(c, (False, "shared", 1)) == [("BlockRemoved", "turbine.kvbm/shared", [1])]
    assert c._where == {} and step(c) == []


def test_the_stream_through_the_relay_into_the_router_index():
    c = scheduler_half()
    index = KvIndexer(BS)
    index.set_shared_tiers({"w": "tier-1", "other": "tier-1"})

    c.update_connector_output(SimpleNamespace(invalid_block_ids=set(), kv_connector_worker_meta=KvbmWorkerMetadata(
        [(True, "host", 10), (True, "disk", 10), (True, "shared", 10), (True, "disk", 11)])))
    for e in c.take_events():
        index.apply(W, translate(e))
    assert index.tier_matches([10, 11, 12], [W, WorkerKey("other")], {}) == {
        W: ["host", "disk"], WorkerKey("other"): ["shared"]}
    c.update_connector_output(SimpleNamespace(invalid_block_ids=set(), kv_connector_worker_meta=KvbmWorkerMetadata(
        [(False, "host", 10), (False, "disk", 10), (False, "shared", 10), (False, "disk", 11)])))
    for e in c.take_events():
        index.apply(W, translate(e))
    assert index.tier_matches([10, 11], [W, WorkerKey("other")], {}) == {}

"""The router's view of workers' KV tiers (--connector kvbm): tier events in the index, a shared tier
counted for every worker that sees it, and the cost ranking an engine hit < a tier hit < recomputing."""

from __future__ import annotations

import random

import msgspec
import pytest

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from turbine.router.config import KvRouterConfig
from turbine.router.cost import TIER_WEIGHTS, tier_credit, worker_costs, WorkerLoad
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_router import KvRouter
from turbine.worker.kv_cache_state import KvCacheState

BS = 16
A, B, C = WorkerKey("a"), WorkerKey("b"), WorkerKey("c")
PROMPT = list(range(1000, 1000 + 6 * BS)) + [1, 2, 3]
HASHES = block_hashes(PROMPT, BS)  # 6 full blocks, the router's hashes (what the tiers name blocks by)


def engine_stored(n: int) -> BlockStored:
    """The engine's own event for the prompt's first n blocks (engine hashes 1..n)."""
    return BlockStored.from_token_ids(block_hashes=list(range(1, n + 1)), parent_hash=None,
                                      token_ids=PROMPT[:n * BS], block_size=BS)


def tier_stored(tier: str, hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_hash=None, tokens=b"", block_size=BS, tier=tier)


def test_tier_field_is_backward_compatible_on_the_wire():
    old = BlockStored.from_token_ids(block_hashes=[1], parent_hash=None, token_ids=PROMPT[:BS], block_size=BS)
    raw = msgspec.msgpack.encode(KvEventBatch(instance_id="a", event_id=0, events=[old, BlockRemoved(block_hashes=[1])]))
    assert b"tier" not in raw  # an engine event is what it was before tiers
    decoded = msgspec.msgpack.decode(raw, type=KvEventBatch)
    assert [e.tier for e in decoded.events] == [None, None]
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(tier_stored("disk", [5])), type=BlockStored)
    assert new.tier == "disk" and new.block_hashes == [5]


def test_tier_blocks_continue_the_engine_match_and_leave_only_when_gone_from_every_tier():
    index = KvIndexer(BS)
    index.apply(A, engine_stored(2))
    index.apply(A, tier_stored("disk", HASHES[:4]))
    engine = index.find_matches(HASHES)
    assert engine == {A: 2}
    assert index.tier_matches(HASHES, [A, B], engine) == {A: ["disk", "disk"]}
    # The engine evicts its blocks; the disk tier still holds all four: the worker keeps them (at disk cost).
    index.apply(A, BlockRemoved(block_hashes=[1, 2]))
    assert index.find_matches(HASHES) == {}
    assert index.tier_matches(HASHES, [A], {}) == {A: ["disk"] * 4}
    # The fastest tier changes (promoted to host): a stored event with the new tier.
    index.apply(A, tier_stored("host", HASHES[:1]))
    assert index.tier_matches(HASHES, [A], {}) == {A: ["host", "disk", "disk", "disk"]}
    # Clearing the engine's cache leaves the tiers.
    index.apply(A, AllBlocksCleared())
    assert index.tier_matches(HASHES, [A], {})[A][0] == "host"
    # Gone from every tier: out of the index.
    index.apply(A, BlockRemoved(block_hashes=HASHES[:4], tier="disk"))
    assert index.tier_matches(HASHES, [A], {}) == {}
    assert index.tier_blocks_of(A) == 0


def test_a_shared_tier_block_counts_for_every_worker_that_sees_the_tier():
    index = KvIndexer(BS)
    index.set_shared_tiers({"a": "t1", "b": "t1", "c": None})
    index.apply(A, tier_stored("shared", HASHES[:3]))
    assert index.tier_matches(HASHES, [A, B, C], {}) == {A: ["shared"] * 3, B: ["shared"] * 3}
    # Another worker saw one gone: it is gone for all.
    index.apply(B, BlockRemoved(block_hashes=HASHES[1:2], tier="shared"))
    assert index.tier_matches(HASHES, [A, B], {}) == {A: ["shared"], B: ["shared"]}
    # A worker whose card names no shared tier publishes nothing the others can use.
    index.apply(C, tier_stored("shared", HASHES[3:]))
    assert index.tier_matches(HASHES, [A, B, C], {}) == {A: ["shared"], B: ["shared"]}
    # A tier nobody sees any more is forgotten.
    index.set_shared_tiers({"c": None})
    assert index.tier_matches(HASHES, [A, B], {}) == {}


def test_leaving_drops_a_workers_own_tiers():
    index = KvIndexer(BS)
    index.apply(A, tier_stored("host", HASHES))
    index.remove_instance("a")
    assert index.tier_matches(HASHES, [A], {}) == {}


@pytest.mark.parametrize("tier", ["host", "disk", "shared"])
def test_cost_engine_hit_cheaper_than_tier_hit_cheaper_than_recomputing(tier):
    assert 0 < TIER_WEIGHTS[tier] < 1
    loads = {A: WorkerLoad(), B: WorkerLoad(), C: WorkerLoad()}
    # A holds 4 blocks in its engine, B the same 4 in a tier, C nothing.
    costs = worker_costs({A: 4}, loads, len(PROMPT), BS, 4.0, tier_credits={B: tier_credit([tier] * 4)})
    assert costs[A] < costs[B] < costs[C]


def test_router_keeps_routing_to_a_worker_whose_engine_evicted_a_prefix_its_disk_holds():
    router = KvRouter(KvRouterConfig(), BS, rng=random.Random(0))
    router.index.apply(A, engine_stored(6))
    router.index.apply(A, tier_stored("disk", HASHES))
    assert router.decide("r1", PROMPT, [A, B], track=False).worker == A
    router.index.apply(A, BlockRemoved(block_hashes=list(range(1, 7))))  # evicted from the engine
    d = router.decide("r2", PROMPT, [A, B], track=False)
    assert d.worker == A and d.overlap_blocks == 0  # still A: loading from disk beats recomputing on B
    router.index.apply(A, BlockRemoved(block_hashes=HASHES, tier="disk"))  # gone from every tier
    costs = router.decide("r3", PROMPT, [A, B], track=False).costs
    assert costs[A] == costs[B]  # A holds nothing more than B now


def test_the_workers_snapshot_carries_its_tiers():
    state = KvCacheState()
    state.apply(engine_stored(2))
    state.apply(tier_stored("disk", HASHES[:3]))
    state.apply(tier_stored("host", HASHES[:1]))
    state.apply(tier_stored("shared", HASHES[:2]))
    state.apply(BlockRemoved(block_hashes=HASHES[2:3], tier="disk"))
    state.apply(AllBlocksCleared())  # the engine's cache only
    index = KvIndexer(BS)
    index.set_shared_tiers({"a": "t"})
    for batch in state.snapshot("a", 0, 9):
        for event in batch.events:
            index.apply(A, event, batch.lora_name)
    assert index.find_matches(HASHES) == {}
    assert index.tier_matches(HASHES, [A], {}) == {A: ["host", "disk"]}


def test_engine_only_routing_drops_the_tier_events():
    # --no-router-kv-tiers: the peer the tier-aware cost is measured against (benchmarks/kv_tiers/kv_tiers_fleet.py).
    router = KvRouter(KvRouterConfig(use_kv_tiers=False), BS, rng=random.Random(0))
    router.index.apply(A, engine_stored(6))
    router.index.apply(A, tier_stored("disk", HASHES))
    assert router.decide("r1", PROMPT, [A, B], track=False).worker == A  # its engine's blocks still count
    router.index.apply(A, BlockRemoved(block_hashes=list(range(1, 7))))  # evicted from the engine
    costs = router.decide("r2", PROMPT, [A, B], track=False).costs
    assert costs[A] == costs[B]  # the disk copy is not seen
    assert router.index.tier_matches(HASHES, [A], {}) == {}
    assert router.index.events_applied == 3  # counted (the events watchdog), not indexed


def test_engine_only_routing_is_refused_where_it_would_do_nothing():
    from turbine.config import ConfigError
    from turbine.router.policy import RouterConfig

    with pytest.raises(ConfigError, match="no-router-kv-tiers.*no-router-kv-events|use_kv_tiers"):
        KvRouterConfig(use_kv_events=False, use_kv_tiers=False)
    with pytest.raises(ConfigError, match="--no-router-kv-tiers needs --router-mode kv"):
        RouterConfig(mode="round-robin", kv=KvRouterConfig(use_kv_tiers=False))
    assert RouterConfig(mode="kv", kv=KvRouterConfig(use_kv_tiers=False)).kv.use_kv_tiers is False


def test_the_engine_only_flag_parses():
    import argparse

    from turbine.router.config import add_kv_router_args, kv_router_config_from_args

    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_config_from_args(parser.parse_args([]), parser).use_kv_tiers is True
    assert kv_router_config_from_args(parser.parse_args(["--no-router-kv-tiers"]), parser).use_kv_tiers is False

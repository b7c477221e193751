"""The KV router end to end in one process: decisions follow cached prefixes and load."""

from __future__ import annotations

import random

from turbine.protocol.kv_events import BlockStored
from turbine.router.approx import ApproxKvIndexer
from turbine.router.hashing import block_hashes
from turbine.router.indexer import WorkerKey
from turbine.router.config import KvRouterConfig
from turbine.router.kv_router import KvRouter

BS = 16
W = [WorkerKey("a"), WorkerKey("b"), WorkerKey("c")]
SYSTEM = list(range(100, 100 + 4 * BS))  # a shared 4-block system prompt


def test_events_mode_routes_to_the_worker_holding_the_prefix():
    router = KvRouter(KvRouterConfig(), BS, rng=random.Random(0))
    router.index.apply(W[1], BlockStored.from_token_ids(block_hashes=[1, 2, 3, 4], parent_hash=None, token_ids=SYSTEM,
                                                        block_size=BS))
    d = router.decide("r1", SYSTEM + [7, 8, 9], W)
    assert d.worker == W[1] and d.overlap_blocks == 4
    router.finished("r1")


def test_a_prompt_without_token_ids_is_routed_on_load_alone():
    """Prompt embeddings come with no token ids: nothing to hash, so the choice is load-only
    (no crash, no overlap with an empty prompt's 'blocks'), and nothing is learned from it."""
    router = KvRouter(KvRouterConfig(use_kv_events=False), BS, rng=random.Random(0))
    busy = router.decide("busy", SYSTEM * 4, [W[0]])  # a long request in flight on a
    assert busy.worker == W[0]
    d = router.decide("embeds", [], W)
    assert d.worker != W[0] and d.overlap_blocks == 0 and d.prompt_blocks == 0
    router.finished("embeds")
    assert router.decide("embeds-2", [], W).worker != W[0]


def test_approximate_mode_learns_from_its_own_decisions():
    router = KvRouter(KvRouterConfig(use_kv_events=False), BS, rng=random.Random(0))
    first = router.decide("r1", SYSTEM + [1, 2, 3], W)
    router.first_token("r1")
    router.finished("r1")
    # A later request with the same system prompt goes where that prefix was sent.
    again = router.decide("r2", SYSTEM + [4, 5, 6], W)
    assert again.worker == first.worker and again.overlap_blocks == 4
    router.finished("r2")
    router.instance_left(first.worker.instance_id)
    assert router.decide("r3", SYSTEM, [w for w in W if w != first.worker]).overlap_blocks == 0


def test_approximate_entries_expire():
    now = [0.0]
    index = ApproxKvIndexer(ttl_s=10, clock=lambda: now[0])
    hashes = block_hashes(SYSTEM, BS)
    index.record(W[0], hashes)
    assert index.find_matches(hashes) == {W[0]: 4}
    now[0] = 11.0
    assert index.find_matches(hashes) == {}
    index.prune()
    assert len(index) == 0


def test_approximate_index_is_bounded():
    index = ApproxKvIndexer(ttl_s=10, max_entries=100)
    for i in range(50):
        index.record(W[i % 3], block_hashes(list(range(i * BS, (i + 4) * BS)), BS))
    assert len(index) <= 100

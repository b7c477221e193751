"""The cost function: overlap wins when queues are equal, load spreads a burst."""

from __future__ import annotations

import random
from collections import Counter

from turbine.router.cost import LoadTracker, WorkerLoad, choose_worker, new_blocks, worker_costs
from turbine.router.indexer import WorkerKey

BS = 128
W = [WorkerKey(f"w{i}") for i in range(4)]


def decide(tracker, overlaps, prompt_tokens, weight=1.0, temperature=0.0, rng=None):
    loads = {w: tracker.load(w) for w in W}
    costs = worker_costs(overlaps, loads, prompt_tokens, BS, weight)
    return choose_worker(costs, loads, temperature, rng or random.Random(0)), costs


def test_cost_formula():
    loads = {W[0]: WorkerLoad(active_blocks=10, prefill_tokens=256), W[1]: WorkerLoad()}
    costs = worker_costs({W[0]: 4}, loads, prompt_tokens=1024, block_size=BS, overlap_weight=2.0)
    # new blocks hold prompt + 1 token: ceil(1025/128) = 9, minus the overlap.
    # W0: 2 × (256 + 1024 − 512)/128 + (10 + 9 − 4) = 2×6 + 15 = 27;  W1: 2×8 + 9 = 25
    assert costs == {W[0]: 27.0, W[1]: 25.0}


def test_cached_prefix_wins_between_idle_workers():
    worker, _ = decide(LoadTracker(), {W[2]: 6}, prompt_tokens=1024)
    assert worker == W[2]


def test_burst_of_identical_requests_spreads_by_load():
    # 8 identical 1024-token requests arrive together. The first lands somewhere; the index
    # then says that worker holds the prefix, but its prefill is still queued, so the
    # following requests see its queue and go elsewhere instead of herding onto it.
    tracker, overlaps, placed = LoadTracker(), {}, Counter()
    for i in range(8):
        worker, _ = decide(tracker, overlaps, prompt_tokens=1024)
        uncached = 1024 - overlaps.get(worker, 0) * BS
        tracker.add(f"r{i}", worker, prefill_tokens=uncached, blocks=new_blocks(1024, overlaps.get(worker, 0), BS))
        overlaps[worker] = 8  # approximate mode: the router assumes the prefix is now cached there
        placed[worker] += 1
    assert sorted(placed.values()) == [2, 2, 2, 2], placed


def test_after_prefill_the_cache_holder_gets_the_repeat():
    tracker = LoadTracker()
    tracker.add("r0", W[1], prefill_tokens=1024, blocks=8)
    tracker.prefill_done("r0")
    worker, _ = decide(tracker, {W[1]: 8}, prompt_tokens=1024)
    assert worker == W[1]
    tracker.free("r0")
    assert tracker.load(W[1]) == WorkerLoad()


def test_ties_go_to_the_less_loaded_worker():
    tracker = LoadTracker()
    loads = {W[0]: WorkerLoad(active_blocks=5), W[1]: WorkerLoad(active_blocks=1)}
    assert choose_worker({W[0]: 3.0, W[1]: 3.0}, loads) == W[1]
    assert tracker.load(W[3]) == WorkerLoad()


def test_temperature_samples_in_proportion():
    loads = {w: WorkerLoad() for w in W[:2]}
    rng = random.Random(1)
    picks = Counter(choose_worker({W[0]: 0.0, W[1]: 10.0}, loads, temperature=1.0, rng=rng) for _ in range(4000))
    # p(W1)/p(W0) = exp(-1) ≈ 0.37
    assert 0.30 < picks[W[1]] / picks[W[0]] < 0.44
    cold = Counter(choose_worker({W[0]: 0.0, W[1]: 10.0}, loads, temperature=0.01, rng=rng) for _ in range(200))
    assert cold[W[1]] == 0


def test_forget_instance():
    tracker = LoadTracker()
    tracker.add("r", W[0], 100, 2)
    tracker.forget_instance(W[0].instance_id)
    tracker.free("r")
    assert tracker.load(W[0]) == WorkerLoad()


def test_requests_another_router_queued_count_from_the_workers_report():
    from turbine.protocol.load_metrics import LoadMetrics
    tracker = LoadTracker()
    tracker.report(W[0], LoadMetrics(instance_id=W[0].instance_id, kv_active_blocks=0, kv_total_blocks=100,
                                     num_running=0, num_waiting=3))
    assert tracker.load(W[0]).other_waiting == 3
    tracker.add("mine", W[0], prefill_tokens=128, blocks=2)
    assert tracker.load(W[0]).other_waiting == 2  # the worker's count may include ours
    worker, costs = decide(tracker, {}, prompt_tokens=1024)
    # W0: two more 9-block requests waiting (the size of this one), besides ours (its 2 blocks, 1 prompt block)
    assert worker != W[0] and costs[W[0]] - costs[W[1]] == 2 * 9 + 2 + 1

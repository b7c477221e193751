"""Load tracking: the workers' own reports merged with what the router just sent them.

The router counts a request itself from the moment it routes it until a worker report that
must include it arrives (one received after the request's first token); then the report's
numbers take over. Never both (no double counting), never neither (no under-counting)."""

from __future__ import annotations

import random
from collections import Counter

from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.cost import LoadTracker, WorkerLoad
from turbine.router.indexer import WorkerKey
from turbine.router.config import KvRouterConfig
from turbine.router.kv_router import KvRouter

BS = 16
W = [WorkerKey(f"w{i}") for i in range(4)]


def report(worker: WorkerKey, active: int, running: int = 0, waiting: int = 0) -> LoadMetrics:
    return LoadMetrics(instance_id=worker.instance_id, kv_active_blocks=active, kv_total_blocks=1000,
                       num_running=running, num_waiting=waiting)


def test_hand_over_counts_each_request_exactly_once():
    t = LoadTracker()
    t.report(W[0], report(W[0], active=5))  # someone else's request runs there
    t.add("r", W[0], prefill_tokens=64, blocks=5)
    assert t.load(W[0]) == WorkerLoad(active_blocks=10, prefill_tokens=64)
    # A report that was on its way before the worker admitted "r" must not erase it.
    t.report(W[0], report(W[0], active=5, waiting=1))
    assert t.load(W[0]) == WorkerLoad(active_blocks=10, prefill_tokens=64)
    t.prefill_done("r")  # first token: prompt computed; the blocks still ours until a report
    # (the last report's waiting request, "r" itself, counts as another router's until the next one)
    assert t.load(W[0]) == WorkerLoad(active_blocks=10, prefill_tokens=0, other_waiting=1)
    t.report(W[0], report(W[0], active=10, running=2))  # now includes "r": the report takes over
    assert t.load(W[0]) == WorkerLoad(active_blocks=10)
    assert t.pending(W[0]) == WorkerLoad()
    t.free("r")  # finished: the worker's next report drops its blocks, not us (again)
    assert t.load(W[0]) == WorkerLoad(active_blocks=10)
    t.report(W[0], report(W[0], active=5, running=1))
    assert t.load(W[0]) == WorkerLoad(active_blocks=5)


def test_a_request_that_ends_before_the_hand_over_leaves_nothing_behind():
    t = LoadTracker()
    t.add("r", W[1], prefill_tokens=32, blocks=3)
    t.prefill_done("r")
    t.free("r")
    t.report(W[1], report(W[1], active=0))  # must not subtract "r" a second time
    assert t.load(W[1]) == WorkerLoad()
    assert t.pending(W[1]) == WorkerLoad()


def test_a_worker_that_never_reports_is_counted_by_the_router_until_the_end():
    t = LoadTracker()
    t.add("r", W[2], prefill_tokens=32, blocks=3)
    t.prefill_done("r")
    assert t.load(W[2]) == WorkerLoad(active_blocks=3)
    t.report(W[3], report(W[3], active=7))  # another worker's report changes nothing here
    assert t.load(W[2]) == WorkerLoad(active_blocks=3)
    t.free("r")
    assert t.load(W[2]) == WorkerLoad()


def test_forgetting_a_worker_drops_its_reports_and_requests():
    t = LoadTracker()
    t.report(W[0], report(W[0], active=9))
    t.add("r", W[0], 16, 2)
    t.forget_instance(W[0].instance_id)
    t.prefill_done("r")
    t.free("r")
    assert t.load(W[0]) == WorkerLoad() and t.reported(W[0]) is None


def test_burst_spreads_although_the_workers_reports_still_say_idle():
    # 8 identical requests arrive at once; every worker reported itself idle, and reports keep
    # coming (they cannot include requests not yet admitted). The router's own counts of what
    # it just sent spread the burst instead of herding it onto one worker.
    router = KvRouter(KvRouterConfig(), BS, rng=random.Random(0))
    prompt = list(range(8 * BS))
    for w in W:
        router.loads.report(w, report(w, active=0))
    placed = Counter()
    for i in range(8):
        placed[router.decide(f"r{i}", prompt, W).worker] += 1
        for w in W:  # stale reports in between
            router.loads.report(w, report(w, active=0))
    assert sorted(placed.values()) == [2, 2, 2, 2], placed


def test_reported_load_of_other_routers_traffic_steers_decisions():
    # A worker busy with requests this router never saw (another frontend's) reports its
    # blocks; the router sends new work elsewhere.
    router = KvRouter(KvRouterConfig(), BS, rng=random.Random(0))
    router.loads.report(W[0], report(W[0], active=500, running=20))
    for w in W[1:]:
        router.loads.report(w, report(w, active=0))
    picks = {router.decide(f"r{i}", list(range(4 * BS)), W).worker for i in range(6)}
    assert W[0] not in picks


def test_a_request_routed_again_counts_only_on_its_last_worker():
    # The frontend re-routes a request whose first worker could not be reached.
    t = LoadTracker()
    t.add("r", W[0], prefill_tokens=32, blocks=3)
    t.add("r", W[1], prefill_tokens=32, blocks=3)
    assert t.load(W[0]) == WorkerLoad() and t.load(W[1]) == WorkerLoad(3, 32)
    t.free("r")
    assert t.load(W[1]) == WorkerLoad()

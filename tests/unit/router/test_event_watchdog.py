"""The KV event watchdog: a worker that should have sent KV events and did not is named once
per episode, with a kind (none_arrived / stopped); idle workers are never suspected."""

from __future__ import annotations

import logging

from turbine.protocol.kv_events import BlockStored
from turbine.router.event_watchdog import NONE_ARRIVED, STOPPED, EventWatchdog
from turbine.router.indexer import KvIndexer, WorkerKey

BS = 4


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(hashes, parent=None, tokens=None) -> BlockStored:
    return BlockStored.from_token_ids(block_hashes=list(hashes), parent_hash=parent,
                                      token_ids=tokens or list(range(len(hashes) * BS)), block_size=BS)


def setup(deadline=10.0):
    index, clock = KvIndexer(BS), Clock()
    raised = []
    dog = EventWatchdog("m", lambda i: index.events_of.get(i, 0), deadline, clock=clock,
                        on_warning=lambda w, k: raised.append((w, k)))
    dog.follow({"a": "tcp://10.0.0.1:5000", "b": "tcp://10.0.0.2:5000"})
    return index, clock, dog, raised


def test_events_that_never_arrive_are_named_once(caplog):
    caplog.set_level(logging.WARNING)
    index, clock, dog, raised = setup()
    dog.expect("r1", "a")
    clock.now += 30  # no first token yet: nothing is expected so far
    assert dog.check() == []
    dog.first_token("r1")
    clock.now += 9.9
    assert dog.check() == []
    clock.now += 0.2
    assert dog.check() == [("a", NONE_ARRIVED)]
    assert "worker a (model 'm'): KV events expected but none arrived in 10s" in caplog.text
    assert "tcp://10.0.0.1:5000" in caplog.text
    # The same episode: more overdue requests raise nothing new.
    dog.expect("r2", "a")
    dog.first_token("r2")
    clock.now += 11
    assert dog.check() == []
    assert raised == [("a", NONE_ARRIVED)] and dog.warnings[("a", NONE_ARRIVED)] == 1


def test_events_that_stop_are_named_and_a_new_episode_can_follow(caplog):
    caplog.set_level(logging.WARNING)
    index, clock, dog, raised = setup()
    index.apply(WorkerKey("b"), stored([1]))
    assert dog.check() == []  # events flow
    clock.now += 60
    dog.expect("r1", "b")
    dog.first_token("r1")
    clock.now += 10.5
    assert dog.check() == [("b", STOPPED)]
    assert "worker b (model 'm'): KV events stopped" in caplog.text
    index.apply(WorkerKey("b"), stored([2]))  # they flow again: the episode ends
    clock.now += 1
    assert dog.check() == []
    dog.expect("r2", "b")
    dog.first_token("r2")
    clock.now += 11
    assert dog.check() == [("b", STOPPED)]
    assert dog.warnings[("b", STOPPED)] == 2


def test_events_that_arrive_in_time_raise_nothing():
    index, clock, dog, raised = setup()
    dog.expect("r1", "a")
    dog.first_token("r1")
    clock.now += 3
    index.apply(WorkerKey("a"), stored([7]))
    clock.now += 30
    assert dog.check() == [] and raised == []


def test_idle_failed_and_unfollowed_requests_expect_nothing():
    index, clock, dog, raised = setup()
    clock.now += 1000  # an idle worker sends nothing and is not suspected
    assert dog.check() == []
    dog.expect("failed", "a")
    dog.finished("failed")  # no first token: nothing was prefilled
    dog.first_token("failed")
    dog.expect("elsewhere", "z")  # a worker whose events are not expected (not followed)
    dog.first_token("elsewhere")
    clock.now += 60
    assert dog.check() == []


def test_a_worker_that_leaves_is_forgotten():
    index, clock, dog, raised = setup()
    dog.expect("r1", "a")
    dog.first_token("r1")
    dog.follow({"b": "tcp://10.0.0.2:5000"})
    clock.now += 60
    assert dog.check() == []


async def test_the_model_router_expects_events_only_for_blocks_new_to_the_worker():
    from turbine.protocol.discovery import ModelCard
    from turbine.router.config import KvRouterConfig
    from turbine.router.model_router import ModelKvRouter

    def card(i, bs=BS):
        return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=i,
                         tokenizer_path="", context_length=100, kv_block_size=bs, total_kv_blocks=10,
                         max_num_seqs=1, max_num_batched_tokens=10, kv_events_address="tcp://127.0.0.1:1")

    clock = Clock()
    router = ModelKvRouter("m", KvRouterConfig(), BS, clock=clock)
    router.instances_changed({"a": card("a"), "odd": card("odd", bs=8)})
    try:
        prompt = list(range(2 * BS))
        router.kv.index.apply(WorkerKey("a"), stored([1, 2], tokens=prompt))
        router.watchdog.check()  # that event was seen
        d = router.decide("known", prompt + [99], ["a"])  # all of its full blocks are indexed on "a"
        assert d.overlap_blocks == d.prompt_blocks == 2
        router.first_token("known")
        router.decide("short", [1, 2], ["a"])  # no full block: nothing to store
        router.first_token("short")
        router.decide("odd-one", prompt, ["odd"])  # its block size differs: the router ignores its events
        router.first_token("odd-one")
        clock.now += 60
        assert router.watchdog.check() == []
        router.decide("new", list(range(50, 50 + 3 * BS)), ["a"])
        router.first_token("new")
        clock.now += 60
        assert router.watchdog.check() == [("a", STOPPED)]
    finally:
        router.close()


def test_events_published_before_the_first_token_reaches_the_router_count():
    """The worker stores (and publishes) a prompt's blocks before the router sees its first
    token; a check in between must not make the router wait for events that already came."""
    index, clock, dog, raised = setup()
    dog.expect("r1", "a")
    index.apply(WorkerKey("a"), stored([1, 2]))
    clock.now += 0.5
    assert dog.check() == []  # sees the event before the first token arrives
    dog.first_token("r1")
    clock.now += 30
    assert dog.check() == [] and raised == []

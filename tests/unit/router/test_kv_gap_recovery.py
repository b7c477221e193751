"""Missed KV events are recovered: the router asks the worker's kv_events_replay endpoint (a real
request-plane server) for the batches it lacks, or for a snapshot when they are no longer
buffered, and ends with exactly the index of a router that saw every event."""

from __future__ import annotations

import asyncio
import logging
import socket

import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvReplayRequest
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.runtime.event_plane import EventPublisher
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.kv_replay import KvEventsReplay, serve_kv_replay
from turbine.runtime.registration import KV_EVENTS_REPLAY
from turbine.runtime.request_plane import RequestPlaneServer

BS = 2
W = "w1"
FAST_RETRY = (0.02, 0.05)


def card(address: str, ranks: int = 1) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=W,
                     tokenizer_path="", context_length=100, kv_block_size=BS, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address, data_parallel_size=ranks)


def index_state(index: KvIndexer, worker: WorkerKey):
    return index._engine_to_router.get(worker) or {}, index._refs.get(worker) or {}


def block_hash(parent: int | None, tokens: list[int], lora: str | None) -> int:
    """Content-addressed, as engines hash blocks: the same hash means the same prefix."""
    return xxhash.xxh64_intdigest(repr((parent, tokens, lora)).encode())


class Worker:
    """A worker's KV-event side: publishers (one per dp rank) and the replay endpoint, with a
    reference index that is fed every batch it publishes."""

    def __init__(self, ranks: int = 1, buffer_size: int = 10_000):
        self.publishers = [KvEventPublisher(W, dp_rank=r, buffer_size=buffer_size) for r in range(ranks)]
        self.reference = KvIndexer(BS)
        self.server = RequestPlaneServer()
        # The test hands live batches to the consumer itself (to lose some on purpose), so the
        # card names a real publisher on which nothing is published.
        self.silent = EventPublisher()
        self.ever: list[int] = []  # every block hash stored so far

    async def start(self, handler=None) -> Worker:
        if handler is None:
            serve_kv_replay(self.server, self.publishers)
        else:
            self.server.register(KV_EVENTS_REPLAY, *handler)
        await self.server.start()
        return self

    def publish(self, events, lora=None, rank: int = 0) -> KvEventBatch:
        batch = self.publishers[rank].publish(events, lora)
        for event in events:
            try:
                self.reference.apply(WorkerKey(W, rank), event, lora)
            except ValueError:
                pass
        return batch

    def store(self, n: int, parent: int | None = None, lora=None, rank: int = 0, seed: int = 0) -> KvEventBatch:
        return self.publish([self.stored(n, parent, lora, seed)], lora, rank)

    def stored(self, n: int, parent: int | None, lora, seed: int) -> BlockStored:
        hashes, tokens, prev = [], [], parent
        for i in range(n):
            block = [seed % 7 + i, seed % 5]
            prev = block_hash(prev, block, lora)
            hashes.append(prev)
            tokens += block
        self.ever += hashes
        return BlockStored.from_token_ids(block_hashes=hashes, parent_hash=parent, token_ids=tokens, block_size=BS)

    def matches(self, consumer: KvEventsConsumer, rank: int = 0) -> bool:
        key = WorkerKey(W, rank)
        return index_state(consumer.index, key) == index_state(self.reference, key)

    async def close(self) -> None:
        await self.server.stop()
        for p in (*self.publishers, self.silent):
            p.close()


def follow(worker: Worker, index: KvIndexer | None = None) -> KvEventsConsumer:
    consumer = KvEventsConsumer(index or KvIndexer(BS), retry_s=FAST_RETRY, timeout_s=5)
    consumer.sync({W: card(worker.silent.address, len(worker.publishers))}, {W: worker.server.address})
    return consumer


async def test_a_gap_is_filled_from_the_workers_buffer(caplog):
    caplog.set_level(logging.INFO, "turbine.router")
    worker = await Worker().start()
    consumer = follow(worker)
    await consumer.settle()
    first = worker.store(2)
    consumer.apply(first)
    worker.store(1, parent=first.events[0].block_hashes[-1], seed=1)  # lost
    worker.publish([BlockRemoved(block_hashes=first.events[0].block_hashes[1:])])  # lost
    consumer.apply(worker.store(3, seed=2))
    await consumer.settle()
    assert consumer.gaps == 1 and consumer.recoveries == 1
    assert "KV events 1..2 were missed" in caplog.text and "KV events 1..3 recovered" in caplog.text
    assert worker.matches(consumer)
    consumer.close()
    await worker.close()


async def test_a_gap_beyond_the_buffer_reloads_a_snapshot(caplog):
    caplog.set_level(logging.INFO, "turbine.router")
    worker = await Worker(buffer_size=1).start()
    consumer = follow(worker)
    await consumer.settle()
    first = worker.store(3)
    consumer.apply(first)
    worker.store(2, parent=first.events[0].block_hashes[0], seed=3)  # lost, and gone from the buffer
    worker.publish([BlockRemoved(block_hashes=[first.events[0].block_hashes[0]])])  # the parent goes
    consumer.apply(worker.store(1, seed=4))
    await consumer.settle()
    assert consumer.gaps == 1 and consumer.recoveries == 1
    assert "reloaded from its snapshot at event 3" in caplog.text
    assert worker.matches(consumer)
    consumer.close()
    await worker.close()


async def test_a_router_that_starts_late_learns_the_cache_at_once():
    worker = await Worker(buffer_size=2).start()
    chain = worker.store(3)
    worker.store(2, parent=chain.events[0].block_hashes[2], lora="adapter")
    worker.store(1, seed=5)
    consumer = follow(worker)  # no event arrives after it starts: it asks anyway
    await consumer.settle()
    assert consumer.recoveries == 1 and consumer.index.blocks_of(WorkerKey(W)) == 6
    assert worker.matches(consumer)
    consumer.close()
    await worker.close()


async def test_first_batch_seen_from_a_rank_after_its_start_is_recovered():
    worker = await Worker(ranks=2).start()
    consumer = follow(worker)
    await consumer.settle()
    worker.store(2, rank=1)
    worker.store(1, rank=1, seed=6)
    consumer.apply(worker.store(1, rank=1, seed=7))  # rank 1's event 2: it had events before
    await consumer.settle()
    # The card names both ranks, so rank 1 was followed (and found empty) from the start: what it
    # published before this batch is a gap, recovered. (A rank its card does not name is dropped.)
    assert consumer.recoveries == 1 and consumer.gaps == 1
    assert worker.matches(consumer, rank=1)
    consumer.close()
    await worker.close()


async def test_batches_arriving_during_a_recovery_are_applied_after_it():
    gate = asyncio.Event()
    answered = asyncio.Event()
    worker = Worker(buffer_size=1)
    replay = KvEventsReplay(worker.publishers)

    async def gated(req, ctx):
        chunks = replay.handle(req, ctx)
        first = await chunks.__anext__()  # the answer is built here, as of now
        answered.set()
        await gate.wait()
        yield first
        async for chunk in chunks:
            yield chunk

    await worker.start(handler=(KvReplayRequest, gated))
    consumer = follow(worker)
    await answered.wait()
    # Published after the answer was built, before it arrives: held, then applied.
    consumer.apply(worker.store(2))
    consumer.apply(worker.store(1, seed=8))
    gate.set()
    await consumer.settle()
    assert consumer.index.blocks_of(WorkerKey(W)) == 3
    assert worker.matches(consumer)
    consumer.close()
    await worker.close()


async def test_a_failed_recovery_is_loud_counted_and_retried(caplog):
    with socket.socket() as s:  # a port where nothing listens yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Worker()
    worker.store(2)
    worker.server.port = port
    consumer = KvEventsConsumer(KvIndexer(BS), retry_s=FAST_RETRY, timeout_s=5)
    consumer.sync({W: card(worker.silent.address)}, {W: f"127.0.0.1:{port}"})
    for _ in range(200):
        await asyncio.sleep(0.01)
        if consumer.recovery_failures >= 2:
            break
    assert consumer.recovery_failures >= 2 and consumer.recoveries == 0
    assert f"worker {W} (dp rank 0): recovering missed KV events failed (ConnectFailed" in caplog.text
    consumer.apply(worker.store(1, seed=9))  # held meanwhile
    assert consumer.index.blocks_of(WorkerKey(W)) == 0
    await worker.start()  # the worker is reachable now: the next attempt succeeds
    await consumer.settle()
    assert consumer.recoveries == 1 and worker.matches(consumer)
    consumer.close()
    await worker.close()


# -- property: any event stream, any losses, any start time -----------------------------------
ops = st.lists(st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "clear"]),
    st.integers(0, 1),  # dp rank
    st.integers(0, 50),  # which parent / which blocks
    st.integers(1, 3),  # blocks
    st.sampled_from([None, None, "lora-a"]),
    st.booleans(),  # delivered live (else lost)
    st.integers(0, 3),  # event-loop turns the router gets right after (recoveries progress)
), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, join_at=st.integers(0, 20), buffer_size=st.sampled_from([0, 1, 3, 10_000]))
def test_recovered_index_equals_an_index_fed_every_event(ops, join_at, buffer_size):
    asyncio.run(_scenario(ops, join_at, buffer_size))


async def _scenario(ops, join_at, buffer_size) -> None:
    worker = await Worker(ranks=2, buffer_size=buffer_size).start()
    consumer = None
    try:
        for i, (kind, rank, pick, n, lora, delivered, turns) in enumerate(ops):
            if i == join_at:
                consumer = follow(worker)
            if kind == "store":
                # A parent among all blocks ever stored: cached, evicted or never on this rank.
                parent = worker.ever[pick % len(worker.ever)] if worker.ever and pick % 4 else None
                batch = worker.publish([worker.stored(n, parent, lora, pick)], lora, rank)
            elif kind == "remove" and worker.ever:
                batch = worker.publish([BlockRemoved(block_hashes=worker.ever[pick % len(worker.ever)::7][:n])],
                                       rank=rank)
            else:
                batch = worker.publish([AllBlocksCleared()], rank=rank)
            if consumer is not None and delivered:
                consumer.apply(batch)
            for _ in range(turns):
                await asyncio.sleep(0)
        if consumer is None:
            consumer = follow(worker)
        for rank in (0, 1):  # one last batch each, delivered: a loss at the end shows as a gap
            consumer.apply(worker.publish([], rank=rank))
        await consumer.settle()
        for rank in (0, 1):
            assert worker.matches(consumer, rank), f"rank {rank}"
        assert consumer.recovery_failures == 0
    finally:
        if consumer is not None:
            consumer.close()
        await worker.close()

"""Hypothesis on the event plane's consumers (the router's KV-events and load-metrics intake):
any payload, garbage or well-formed with hostile values, is dropped or applied without raising,
and what the router keeps per worker does not grow with what a publisher makes up (data-parallel
ranks its card does not have). Plus a real zmq publisher sending malformed messages: the
router's subscription keeps delivering the good ones after them."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.cost import LoadTracker
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.router.load_consumer import LoadMetricsConsumer
from turbine.runtime.codec import encode
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, LOAD_METRICS_TOPIC

BS = 4
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
ints = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-3, 8)


def card(instance_id: str, address: str, dp: int = 2) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=BS, total_kv_blocks=10, max_num_seqs=1,
                     max_num_batched_tokens=10, kv_events_address=address, data_parallel_size=dp)


well_formed_stored = st.lists(ints, min_size=1, max_size=3).map(
    lambda hashes: BlockStored(block_hashes=hashes, parent_hash=None, tokens=bytes(len(hashes) * BS * 4),
                               block_size=BS))
events = st.one_of(
    well_formed_stored,
    st.builds(lambda hashes, parent, tokens, size: BlockStored(block_hashes=hashes, parent_hash=parent, tokens=tokens,
                                                               block_size=size),
              st.lists(ints, max_size=4), st.none() | ints, st.binary(max_size=80), st.sampled_from([BS, 0, -1, 16])),
    st.builds(lambda hashes: BlockRemoved(block_hashes=hashes), st.lists(ints, max_size=4)),
    st.just(AllBlocksCleared()),
)
batches = st.builds(lambda iid, eid, evs, rank, lora: KvEventBatch(instance_id=iid, event_id=eid, events=evs,
                                                                    dp_rank=rank, lora_name=lora),
                    st.sampled_from(["w1", "w2", "stranger"]), small | ints, st.lists(events, max_size=4),
                    small | ints, st.none() | st.text(max_size=5))
reports = st.builds(lambda iid, rank, a, t, r, w: LoadMetrics(instance_id=iid, dp_rank=rank, kv_active_blocks=a,
                                                              kv_total_blocks=t, num_running=r, num_waiting=w),
                    st.sampled_from(["w1", "w2", "stranger"]), small | ints, ints, ints, ints, ints)
payloads = st.binary(max_size=300) | batches.map(encode) | reports.map(encode)


async def test_kv_events_consumer_survives_any_payload():
    index = KvIndexer(BS)
    consumer = KvEventsConsumer(index)
    # No request-plane address: nothing to recover from, so the test runs no recovery tasks.
    consumer.sync({"w1": card("w1", "tcp://127.0.0.1:1"), "w2": card("w2", "tcp://127.0.0.1:2", dp=1)})

    @FUZZ
    @given(st.lists(payloads, max_size=6))
    def feed(messages):
        for payload in messages:
            consumer.handle(payload)  # raises nothing
        # Only the ranks the workers' cards have are tracked, whatever the batches said.
        assert set(index._slot) <= {WorkerKey("w1", 0), WorkerKey("w1", 1), WorkerKey("w2", 0)}

    try:
        feed()
    finally:
        consumer.close()


async def test_load_metrics_consumer_survives_any_payload():
    loads = LoadTracker()
    consumer = LoadMetricsConsumer(loads)
    consumer.sync({"w1": card("w1", "tcp://127.0.0.1:1"), "w2": card("w2", "tcp://127.0.0.1:2", dp=1)})

    @FUZZ
    @given(st.lists(payloads, max_size=6))
    def feed(messages):
        for payload in messages:
            consumer.handle(payload)
        assert set(loads.reporting_workers()) <= {WorkerKey("w1", 0), WorkerKey("w1", 1), WorkerKey("w2", 0)}

    try:
        feed()
    finally:
        consumer.close()


async def test_malformed_zmq_messages_do_not_stop_the_subscription():
    """A publisher that sends a message of one part, or of three, or garbage payloads: the
    router's receive loop drops them and delivers the next good message."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    loads = LoadTracker()
    sub = RouterEventSubscriber()
    consumer = LoadMetricsConsumer(loads, subscriber=sub)
    consumer.sync({"w1": card("w1", address)})
    good = LoadMetrics(instance_id="w1", kv_active_blocks=3, kv_total_blocks=10, num_running=1, num_waiting=0)
    try:
        await sub.subscribed(address)
        for _ in range(200):  # until the subscription is through
            pub.send_multipart([LOAD_METRICS_TOPIC, b"\xc1garbage"])
            pub.send_multipart([LOAD_METRICS_TOPIC])  # one part
            pub.send_multipart([LOAD_METRICS_TOPIC, b"a", b"b"])  # three parts
            pub.send_multipart([KV_EVENTS_TOPIC + b"-not-ours", b"x"])
            pub.send_multipart([LOAD_METRICS_TOPIC, msgspec.msgpack.encode({"instance_id": "w1"})])
            pub.send_multipart([LOAD_METRICS_TOPIC, encode(good)])
            await asyncio.sleep(0.02)
            if consumer.received:
                break
        assert consumer.received >= 1 and consumer.rejected >= 1
        assert loads.reported(WorkerKey("w1", 0)) == good
        received = consumer.received
        pub.send_multipart([LOAD_METRICS_TOPIC, b"a", b"b"])
        pub.send_multipart([LOAD_METRICS_TOPIC, encode(good)])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if consumer.received > received:
                break
        assert consumer.received > received  # still delivering after more malformed messages
    finally:
        consumer.close()
        sub.close()
        pub.close()

"""Load metrics over a real zmq event plane: coalesced on the worker's side, followed into the
router's load tracker on the other."""

from __future__ import annotations

import asyncio

from turbine.protocol.discovery import ModelCard
from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.cost import LoadTracker
from turbine.router.indexer import WorkerKey
from turbine.router.load_consumer import LoadMetricsConsumer
from turbine.runtime.codec import decode
from turbine.runtime.event_plane import LOAD_METRICS_TOPIC, EventPublisher, EventSubscriber
from turbine.worker.load_publisher import LoadMetricsPublisher


def card(instance_id: str, address: str | None) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=16, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address)


async def connected(plane: EventPublisher, sub: EventSubscriber) -> None:
    """PUB/SUB needs a moment to connect: send probes (rank 99) until one lands, then drain them."""
    probe = LoadMetrics(instance_id="probe", dp_rank=99, kv_active_blocks=0, kv_total_blocks=0, num_running=0,
                        num_waiting=0)
    for _ in range(200):
        plane.publish(LOAD_METRICS_TOPIC, probe)
        try:
            async with asyncio.timeout(0.02):
                await sub.recv()
                break
        except TimeoutError:
            pass
    await asyncio.sleep(0.05)
    while True:
        try:
            async with asyncio.timeout(0.05):
                await sub.recv()
        except TimeoutError:
            return


async def received(sub: EventSubscriber, wait_s: float) -> list[LoadMetrics]:
    out = []
    try:
        async with asyncio.timeout(wait_s):
            while True:
                topic, payload = await sub.recv()
                assert topic == LOAD_METRICS_TOPIC
                out.append(decode(payload, LoadMetrics))
    except TimeoutError:
        return out


async def test_changes_are_coalesced_and_the_latest_state_wins():
    plane, sub = EventPublisher(), EventSubscriber(topics=(LOAD_METRICS_TOPIC,))
    sub.connect(plane.address)
    pub = LoadMetricsPublisher(plane, "w1", min_interval_s=0.2, keepalive_s=0)
    try:
        await connected(plane, sub)
        for step in range(1, 101):  # 100 engine steps in a burst
            pub.update(0, kv_active_blocks=step, kv_total_blocks=500, num_running=step % 7, num_waiting=1)
        pub.update(1, kv_active_blocks=3, kv_total_blocks=500, num_running=1, num_waiting=0)  # another rank
        msgs = await received(sub, 0.5)
        rank0 = [m for m in msgs if m.dp_rank == 0]
        # The first change goes out at once, the rest as one message with the last state.
        assert [m.kv_active_blocks for m in rank0] == [1, 100]
        assert rank0[-1] == LoadMetrics(instance_id="w1", kv_active_blocks=100, kv_total_blocks=500,
                                        num_running=100 % 7, num_waiting=1)
        assert [m.kv_active_blocks for m in msgs if m.dp_rank == 1] == [3]
        # Unchanged numbers publish nothing.
        pub.update(0, kv_active_blocks=100, kv_total_blocks=500, num_running=100 % 7, num_waiting=1)
        assert await received(sub, 0.3) == []
        assert pub.published == 3
    finally:
        pub.close()
        sub.close()
        plane.close()


async def test_a_quiet_state_is_resent_for_routers_that_start_later():
    plane, sub = EventPublisher(), EventSubscriber(topics=(LOAD_METRICS_TOPIC,))
    pub = LoadMetricsPublisher(plane, "w1", min_interval_s=0.01, keepalive_s=0.2)
    try:
        pub.update(0, kv_active_blocks=0, kv_total_blocks=64, num_running=0, num_waiting=0)  # nobody listens yet
        sub.connect(plane.address)
        msgs = await received(sub, 0.8)
        assert msgs and all(m.kv_total_blocks == 64 for m in msgs)
    finally:
        pub.close()
        sub.close()
        plane.close()


async def test_the_consumer_feeds_the_load_tracker_and_forgets_departed_workers():
    plane = EventPublisher()
    tracker = LoadTracker()
    consumer = LoadMetricsConsumer(tracker)
    consumer.sync({"w1": card("w1", plane.address), "quiet": card("quiet", None)})
    pub = LoadMetricsPublisher(plane, "w1", min_interval_s=0, keepalive_s=0)
    try:
        for n in range(200):  # until the subscription is up: each distinct state is a new message
            pub.update(0, kv_active_blocks=n, kv_total_blocks=99, num_running=1, num_waiting=2)
            await asyncio.sleep(0.01)
            if tracker.reported(WorkerKey("w1")) is not None:
                break
        report = tracker.reported(WorkerKey("w1"))
        assert report is not None and report.kv_total_blocks == 99 and report.num_waiting == 2
        assert tracker.load(WorkerKey("w1")).active_blocks == report.kv_active_blocks
        consumer.apply(LoadMetrics(instance_id="stranger", kv_active_blocks=1, kv_total_blocks=1, num_running=0,
                                   num_waiting=0))
        assert tracker.reported(WorkerKey("stranger")) is None
        consumer.sync({})  # w1 left discovery
        assert tracker.reported(WorkerKey("w1")) is None
    finally:
        consumer.close()
        pub.close()
        plane.close()


async def test_the_active_lora_adapters_travel_in_the_report():
    plane = EventPublisher()
    tracker = LoadTracker()
    consumer = LoadMetricsConsumer(tracker)
    consumer.sync({"w1": card("w1", plane.address)})
    pub = LoadMetricsPublisher(plane, "w1", min_interval_s=0, keepalive_s=0)
    try:
        for n in range(200):  # until the subscription is up: each distinct state is a new message
            pub.update(0, kv_active_blocks=n, kv_total_blocks=99, num_running=1, num_waiting=0, max_loras=2,
                       active_loras=("x", "y"))
            await asyncio.sleep(0.01)
            if tracker.reported(WorkerKey("w1")) is not None:
                break
        report = tracker.reported(WorkerKey("w1"))
        assert report.max_loras == 2 and report.active_loras == ["x", "y"]
        assert tracker.lora_active(WorkerKey("w1"), "y") and not tracker.lora_active(WorkerKey("w1"), "z")
        sent = pub.published
        pub.update(0, kv_active_blocks=n, kv_total_blocks=99, num_running=1, num_waiting=0, max_loras=2,
                   active_loras=("y", "z"))  # only the slots changed: that is news too
        assert pub.published == sent + 1
    finally:
        consumer.close()
        pub.close()
        plane.close()

"""One event-plane subscriber per router: one connection per worker, each topic to its consumer."""

from __future__ import annotations

import asyncio

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import BlockStored
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.router.hashing import block_hashes
from turbine.router.indexer import WorkerKey
from turbine.router.config import KvRouterConfig
from turbine.router.model_router import ModelKvRouter
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, LOAD_METRICS_TOPIC
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.load_publisher import LoadMetricsPublisher

BS = 4
TOKENS = list(range(100, 100 + 2 * BS))


def card(instance_id: str, address: str | None, block_size: int = BS) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=block_size, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address)


async def test_one_connection_per_worker_carries_kv_events_and_load_reports():
    router = ModelKvRouter("m", KvRouterConfig(), BS)
    w1, odd = KvEventPublisher("w1"), KvEventPublisher("odd")
    loads = {p.instance_id: LoadMetricsPublisher(p.events_plane, p.instance_id, min_interval_s=0, keepalive_s=0)
             for p in (w1, odd)}
    try:
        router.instances_changed({"w1": card("w1", w1.address), "odd": card("odd", odd.address, block_size=8)})
        sub = router.subscriber._sub
        assert sub.addresses == {w1.address, odd.address}  # one connection each, not one per consumer
        assert set(sub.topics) == {KV_EVENTS_TOPIC, LOAD_METRICS_TOPIC}
        hashes = block_hashes(TOKENS, BS)
        async with asyncio.timeout(5):
            n = 0
            while not (router.kv.index.find_matches(hashes) and router.kv.loads.reported(WorkerKey("odd"))):
                w1.publish([BlockStored.from_token_ids(block_hashes=[1, 2], parent_hash=None, token_ids=TOKENS,
                                                       block_size=BS)])
                for i, pub in enumerate(loads.values()):
                    pub.update(0, kv_active_blocks=n + i, kv_total_blocks=99, num_running=1, num_waiting=0)
                n += 2
                await asyncio.sleep(0.02)
        assert router.kv.index.find_matches(hashes) == {WorkerKey("w1"): 2}
        assert router.kv.loads.reported(WorkerKey("w1")).kv_total_blocks == 99
        # The worker with another block size: its load is followed, its cache is not.
        assert router.kv.index.blocks_of(WorkerKey("odd")) == 0
        router.instances_changed({"odd": card("odd", odd.address, block_size=8)})  # w1 leaves
        assert sub.addresses == {odd.address}
        assert router.kv.index.find_matches(hashes) == {} and router.kv.loads.reported(WorkerKey("w1")) is None
        router.instances_changed({})
        assert sub.addresses == set()
    finally:
        router.close()
        for p in (w1, odd):
            p.close()


async def test_a_connection_stays_while_anyone_follows_it_and_handler_errors_do_not_stop_the_rest(caplog):
    sub = RouterEventSubscriber()
    got = []

    def broken(payload: bytes) -> None:
        raise RuntimeError("bug")
    sub.on(KV_EVENTS_TOPIC, broken)
    sub.on(LOAD_METRICS_TOPIC, got.append)
    pub = KvEventPublisher("w")
    try:
        sub.follow(pub.address)
        sub.follow(pub.address)
        sub.unfollow(pub.address)
        assert sub._sub.addresses == {pub.address}
        await sub.subscribed(pub.address)
        async with asyncio.timeout(5):
            while not got:
                pub.events_plane.publish_bytes(KV_EVENTS_TOPIC, b"kv")
                pub.events_plane.publish_bytes(LOAD_METRICS_TOPIC, b"load")
                await asyncio.sleep(0.02)
        assert got[0] == b"load" and "could not be handled" in caplog.text
        sub.unfollow(pub.address)
        assert sub._sub.addresses == set()
    finally:
        sub.close()
        pub.close()

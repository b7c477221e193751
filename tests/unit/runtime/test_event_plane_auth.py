"""With a cluster key, a publisher without it cannot put KV events into a router's index: its
messages are dropped before anything decodes them, and logged. Real ZMQ sockets, and a private
NATS server (never the machine's shared one)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.client import Client

from tests.nats_server import NatsServer
from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import BlockStored
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.runtime import cluster_auth
from turbine.runtime.cluster_auth import ClusterAuth
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, WorkerEventPlane
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.kv_replay import serve_kv_replay

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
BS = 4


@pytest.fixture(scope="module")
def private_nats(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats") / "nats.log")
    server.start()  # serving before anyone connects
    try:
        yield server.url
    finally:
        server.stop()


def card(instance_id: str, address: str) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=BS, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address)


def stored(hashes: list[int], first_token: int) -> list:
    return [BlockStored.from_token_ids(block_hashes=hashes, parent_hash=None,
                                       token_ids=[first_token + i for i in range(BS * len(hashes))], block_size=BS)]


async def until(cond, what: str, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("backend", ["zmq", "nats"])
async def test_a_publisher_without_the_key_cannot_inject_kv_events(backend, private_nats, monkeypatch, caplog):
    monkeypatch.setattr(cluster_auth, "_current", ClusterAuth(KEY))  # the router's process has the key
    caplog.set_level(logging.WARNING, "turbine.event_plane")
    honest_plane = await WorkerEventPlane.open(backend, nats_server=private_nats, auth=ClusterAuth(KEY))
    rogue_plane = await WorkerEventPlane.open(backend, nats_server=private_nats, auth=ClusterAuth(OTHER_KEY))
    honest = KvEventPublisher("w1", events_plane=honest_plane.publisher("w1"))
    # zmq: a rogue card in discovery points the router at the rogue's socket; nats: the rogue
    # publishes on the honest worker's own subject.
    rogue_id = "evil" if backend == "zmq" else "w1"
    rogue = KvEventPublisher(rogue_id, events_plane=rogue_plane.publisher(rogue_id))
    server = RequestPlaneServer(auth=ClusterAuth(KEY))
    serve_kv_replay(server, [honest])
    await server.start()
    consumer = KvEventsConsumer(KvIndexer(BS))
    handled: list[bytes] = []
    handle = consumer._sub._handlers[KV_EVENTS_TOPIC]
    consumer._sub._handlers[KV_EVENTS_TOPIC] = lambda payload: (handled.append(payload), handle(payload))
    cards = {"w1": card("w1", honest.address)}
    if backend == "zmq":
        cards["evil"] = card("evil", rogue.address)
    consumer.sync(cards, {"w1": server.address, "evil": server.address})
    await consumer.settle()
    subscriber = consumer._sub._sub
    raw = None
    try:
        # NATS and zmq drop what is published before the subscription is live (lost, not refused):
        # wait for it, then the honest batch first, so that every later message reaches the check.
        await asyncio.wait_for(subscriber.subscribed(honest.address), 10)
        honest.publish(stored([1, 2], 0))
        await until(lambda: consumer.index.blocks_of(WorkerKey("w1")) == 2, "the honest worker's blocks indexed")
        if backend == "nats":
            raw = Client()
            await raw.connect(private_nats)
        # Sent again until dropped: a subscriber that has not joined the rogue's socket (zmq) yet
        # loses the message silently, which proves nothing either way.
        for _ in range(50):
            rogue.publish(stored([101, 102, 103], 500))
            if raw is not None:  # and bytes that are no event at all, straight onto the subject
                await raw.publish(f"turbine.events.w1.{KV_EVENTS_TOPIC.decode()}", b"\xc1 not msgpack")
                await raw.flush()
            await asyncio.sleep(0.2)
            if subscriber.forged >= (2 if raw else 1):
                break
        await until(lambda: subscriber.forged >= (2 if raw else 1), "forged messages dropped")
        assert consumer.index.blocks_of(WorkerKey(rogue_id)) == (2 if rogue_id == "w1" else 0)
        assert consumer.index.find_matches([101]) == {}
        assert len(handled) == 1  # only the honest batch reached the consumer's decoder
        assert consumer.rejected == 0
        assert any("without a valid cluster-key signature" in r.getMessage() and "not decoded" in r.getMessage()
                   for r in caplog.records)
    finally:
        if raw is not None:
            await raw.close()
        consumer.close()
        await server.stop()
        honest.close()
        rogue.close()
        await honest_plane.close()
        await rogue_plane.close()

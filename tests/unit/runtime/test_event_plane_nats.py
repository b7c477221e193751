"""The nats event plane, on a real NATS server ($TURBINE_TEST_NATS, default nats://127.0.0.1:4222):
a worker's KV events reach a router's index, topics stay apart, one connection serves many
publishers, and an unreachable server or a bad flag is a clear error naming the flag."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgspec
import pytest

from turbine.mocker.args import parse_mocker_args
from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import AllBlocksCleared, BlockStored
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.runtime import event_plane_nats
from turbine.runtime.cluster_auth import ClusterAuth
from turbine.runtime.codec import decode
from tests.nats_server import NatsServer
from turbine.runtime.errors import EventPlaneError
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, LOAD_METRICS_TOPIC, EventSubscriber, WorkerEventPlane
from turbine.runtime.event_plane_nats import RESUBSCRIBED
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.kv_replay import serve_kv_replay

BS = 4
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


class Ping(msgspec.Struct, kw_only=True):
    n: int
    v: int = 1


@pytest.fixture
async def plane(nats_url):
    plane = await WorkerEventPlane.open("nats", nats_server=nats_url)
    yield plane
    await plane.close()


def card(instance_id: str, address: str) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=BS, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address)


async def until(cond, what: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("backend", ["nats", "zmq"])
async def test_kv_events_reach_the_index(backend, nats_url):
    # The router picks the backend from the card's address: no flag on its side.
    plane = await WorkerEventPlane.open(backend, nats_server=nats_url)
    pub = KvEventPublisher("nats-w1", events_plane=plane.publisher("nats-w1"))
    if backend == "nats":
        assert pub.address == f"{nats_url}/turbine.events.nats-w1"
    server = RequestPlaneServer()
    serve_kv_replay(server, [pub])
    await server.start()
    consumer = KvEventsConsumer(KvIndexer(BS))
    consumer.sync({"nats-w1": card("nats-w1", pub.address)}, {"nats-w1": server.address})
    await consumer.settle()
    hashes = block_hashes(TOKENS, BS)
    try:
        applied = consumer.index.events_applied
        pub.publish([BlockStored.from_token_ids(block_hashes=[1, 2], parent_hash=None, token_ids=TOKENS,
                                                block_size=BS)])
        pub.publish([BlockStored.from_token_ids(block_hashes=[3], parent_hash=2, token_ids=[9, 9, 9, 9],
                                                block_size=BS)])
        await until(lambda: consumer.index.blocks_of(WorkerKey("nats-w1")) == 3, "stored blocks")
        assert consumer.index.find_matches(hashes) == {WorkerKey("nats-w1"): 2}
        pub.publish([AllBlocksCleared()])
        await until(lambda: consumer.index.blocks_of(WorkerKey("nats-w1")) == 0, "cleared")
        if backend == "nats":
            # Subscribed before the router asked for the past: every event arrived live, once.
            assert consumer.index.events_applied - applied == 3 and consumer.gaps == 0
    finally:
        consumer.close()
        await server.stop()
        pub.close()
        await plane.close()


async def test_topics_stay_apart_and_publishers_share_one_connection(plane):
    a, b = plane.publisher("nats-a"), plane.publisher("nats-b")
    assert a._conn is b._conn  # the mocker's N workers: one connection per process
    loads = EventSubscriber((LOAD_METRICS_TOPIC,))
    loads.connect(a.address)
    loads.connect(b.address)
    await asyncio.sleep(0.2)  # the subscriptions reach the server
    a.publish(KV_EVENTS_TOPIC, Ping(n=0))  # another topic: not for this subscriber
    a.publish(LOAD_METRICS_TOPIC, Ping(n=1))
    threading.Thread(target=b.publish, args=(LOAD_METRICS_TOPIC, Ping(n=2))).start()  # from any thread
    got = []
    async with asyncio.timeout(5):
        while len(got) < 2:
            topic, payload = await loads.recv()
            got.append((topic, decode(payload, Ping).n))
    assert sorted(got) == [(LOAD_METRICS_TOPIC, 1), (LOAD_METRICS_TOPIC, 2)]
    loads.disconnect(a.address)
    await asyncio.sleep(0.2)
    a.publish(LOAD_METRICS_TOPIC, Ping(n=3))
    b.publish(LOAD_METRICS_TOPIC, Ping(n=4))
    async with asyncio.timeout(5):
        assert decode((await loads.recv())[1], Ping).n == 4
    loads.close()


@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["keyless", "cluster-key"])
async def test_a_restarted_server_is_reported_then_events_flow_again(tmp_path, key):
    # A private server: restarting the shared one would break everyone else's tests.
    server = NatsServer(tmp_path / "nats.log")
    await asyncio.to_thread(server.start)
    auth = ClusterAuth(key)  # with a key, the report (ours, not from the wire) is not taken for a forgery
    plane = await WorkerEventPlane.open("nats", nats_server=server.url, auth=auth)
    pub = plane.publisher("nats-r")
    sub = EventSubscriber((LOAD_METRICS_TOPIC,), auth=auth)
    try:
        sub.connect(pub.address)
        await sub.subscribed(pub.address)
        server.stop()
        await asyncio.to_thread(server.start)
        async with asyncio.timeout(10):
            # Told that what was published meanwhile may be lost (the cue for routers to recover)...
            assert await sub.recv() == (RESUBSCRIBED, pub.address.encode())
            # ...and subscribed again: the publisher's next message arrives.
            while True:
                pub.publish(LOAD_METRICS_TOPIC, Ping(n=5))
                try:
                    async with asyncio.timeout(0.5):
                        topic, payload = await sub.recv()
                    break
                except TimeoutError:  # the publisher may still be reconnecting
                    pass
        assert (topic, decode(payload, Ping).n) == (LOAD_METRICS_TOPIC, 5)
        assert sub.forged == 0
    finally:
        sub.close()
        await plane.close()
        server.stop()


async def test_an_unreachable_nats_server_is_an_error_naming_the_flag(monkeypatch):
    monkeypatch.setattr(event_plane_nats, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EventPlaneError, match=rf"--nats-server: cannot reach the NATS server nats://127.0.0.1:{port}"):
        await WorkerEventPlane.open("nats", nats_server=f"nats://127.0.0.1:{port}")


def test_event_plane_flags(monkeypatch):
    cfg = parse_mocker_args([])
    assert (cfg.event_plane, cfg.nats_server, cfg.kv_events_buffer) == ("zmq", "nats://127.0.0.1:4222", 10_000)
    monkeypatch.setenv("TURBINE_NATS_SERVER", "nats://10.1.2.3")
    cfg = parse_mocker_args(["--event-plane", "nats", "--kv-events-buffer", "0"])
    assert (cfg.event_plane, cfg.nats_server, cfg.kv_events_buffer) == ("nats", "nats://10.1.2.3:4222", 0)


@pytest.mark.parametrize("argv,flag", [
    (["--event-plane", "kafka"], "--event-plane"),
    (["--nats-server", "http://127.0.0.1:4222"], "--nats-server"),
    (["--nats-server", "nats://127.0.0.1:port"], "--nats-server"),
    (["--kv-events-buffer", "-1"], "--kv-events-buffer"),
])
def test_bad_event_plane_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_mocker_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_vllm_worker_has_the_same_flags(capsys):
    from turbine.vllm.args import parse_worker_args

    cfg = parse_worker_args(["--event-plane", "nats", "--nats-server", "nats://127.0.0.1:4333", "--enforce-eager"])
    assert (cfg.event_plane, cfg.nats_server) == ("nats", "nats://127.0.0.1:4333")
    with pytest.raises(SystemExit) as info:
        parse_worker_args(["--event-plane", "carrier-pigeon"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "(--event-plane): 'carrier-pigeon'" in err

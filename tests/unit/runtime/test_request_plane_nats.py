"""What only the NATS request plane has (turbine/runtime/request_plane_nats.py), on real nats-servers:
messages on a subject instead of bytes on a socket (garbage and forgeries dropped before decoding, the
documented batches), lost and replayed batches, a dead or hung peer on either side, a restarted NATS
server, the size limit of the NATS server named, and the cluster key's signatures. The behaviour both
planes share runs on both in test_request_plane.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import msgspec
import nats
import pytest

from tests.nats_server import NatsServer
from turbine.protocol.frames import CANCEL, CHUNK, END, REQUEST, Batch, Frame
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime import request_plane_nats
from turbine.runtime.cluster_auth import ClusterAuth, RateLimitedWarning
from turbine.runtime.errors import ConnectFailed, FrameTooLarge, PeerDisconnected, RemoteError
from turbine.runtime.request_plane_nats import NatsRequestPlaneClient, NatsRequestPlaneServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def req(rid: str, n: int = 3, ids: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", token_ids=ids or [1], stop=StopConditions(max_tokens=n))


class Handlers:
    def __init__(self):
        self.handled: list[str] = []
        self.finalized: dict[str, bool] = {}

    async def generate(self, r: GenerateRequest, ctx):
        self.handled.append(r.request_id)
        for i in range(r.stop.max_tokens or 0):
            yield GenerateOutput(token_ids=[i])

    async def hang(self, r: GenerateRequest, ctx):
        self.handled.append(r.request_id)
        try:
            yield GenerateOutput(token_ids=[0])
            await asyncio.Event().wait()
        finally:
            self.finalized[r.request_id] = ctx.cancelled

    async def slow(self, r: GenerateRequest, ctx):
        try:
            for i in range(r.stop.max_tokens or 0):
                yield GenerateOutput(token_ids=[i])
                await asyncio.sleep(0.1)
        finally:
            self.finalized[r.request_id] = ctx.cancelled

    async def big(self, r: GenerateRequest, ctx):
        yield GenerateOutput(token_ids=list(range(400_000)))


@pytest.fixture
def warnings_all(monkeypatch):
    """Every dropped message logged (the limiter would hide all but the first in 10 s)."""
    monkeypatch.setattr(request_plane_nats, "_warn", RateLimitedWarning(request_plane_nats.logger))


async def serving(url: str, auth: ClusterAuth | None = None) -> tuple[NatsRequestPlaneServer, Handlers]:
    handlers = Handlers()
    server = NatsRequestPlaneServer(url, auth=auth or ClusterAuth())
    server.register("generate", GenerateRequest, handlers.generate)
    server.register("hang", GenerateRequest, handlers.hang)
    server.register("big", GenerateRequest, handlers.big)
    server.register("slow", GenerateRequest, handlers.slow)
    await server.start()
    return server, handlers


@pytest.fixture
async def served(nats_url):
    server, handlers = await serving(nats_url)
    yield server, handlers
    await server.stop()


@pytest.fixture
async def client(nats_url):
    c = NatsRequestPlaneClient(nats_url, auth=ClusterAuth())
    yield c
    await c.close()


async def collect(stream) -> list:
    async with asyncio.timeout(5):
        return [item async for item in stream]


async def until(cond, what: str, timeout: float = 5.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


class RawPeer:
    """A bare nats-py client with a subject prefix of its own: speaks the plane by hand."""

    def __init__(self, nc, prefix: str):
        self.nc, self.prefix = nc, prefix
        self.received: list[Batch] = []

    @classmethod
    async def connect(cls, url: str) -> RawPeer:
        peer = cls(await nats.connect(url), f"turbine.rpc.{uuid.uuid4().hex}")
        await peer.nc.subscribe(f"{peer.prefix}.in", cb=peer._on)
        await peer.nc.flush()
        return peer

    async def _on(self, msg) -> None:
        self.received.append(msgspec.msgpack.decode(msg.data, type=Batch))

    async def send(self, server: NatsRequestPlaneServer, batch: Batch | bytes) -> None:
        data = batch if isinstance(batch, bytes) else msgspec.msgpack.encode(batch)
        await self.nc.publish(f"{server._mailbox.prefix}.in", data)
        await self.nc.flush()


# ---------------------------------------------------------------- on the wire


async def test_raw_batches_on_the_wire(served, nats_url):
    """The documented wire format: a Batch of frames on "<prefix>.in", answered on the sender's."""
    server, _ = served
    peer = await RawPeer.connect(nats_url)
    try:
        payload = msgspec.msgpack.encode(req("raw", n=1, ids=[4]))
        await peer.send(server, Batch(sender=peer.prefix, seq=1, frames=[
            Frame(kind=REQUEST, stream_id=7, endpoint="generate", payload=payload)]))
        await until(lambda: [f for b in peer.received for f in b.frames if f.kind == END], "the END frame")
        frames = [f for b in peer.received for f in b.frames]
        assert [(f.kind, f.stream_id) for f in frames] == [(CHUNK, 7), (END, 7)]
        assert msgspec.msgpack.decode(frames[0].payload, type=GenerateOutput) == GenerateOutput(token_ids=[0])
        assert [b.seq for b in peer.received] == list(range(1, len(peer.received) + 1))
        assert all(b.sender == server._mailbox.prefix for b in peer.received)
    finally:
        await peer.nc.close()


@pytest.mark.parametrize("garbage", [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
    pytest.param(b"\xc1", id="undecodable-msgpack"),
    pytest.param(msgspec.msgpack.encode([1, 2]), id="not-a-batch"),
    pytest.param(msgspec.msgpack.encode(Batch(sender="elsewhere.>", seq=1)), id="invalid-sender"),
])
async def test_garbage_on_the_subject_is_dropped_and_serving_goes_on(served, client, nats_url, garbage, caplog,
                                                                     warnings_all):
    server, handlers = served
    healthy = client.stream(server.address, "hang", req("healthy"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(healthy)
    peer = await RawPeer.connect(nats_url)
    try:
        with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
            await peer.send(server, garbage)
            await until(lambda: any("dropped" in r.getMessage() for r in caplog.records), "the drop logged")
    finally:
        await peer.nc.close()
    assert server.inflight == 1 and handlers.handled == ["healthy"]  # nothing else ran; the stream lives
    assert len(await collect(client.stream(server.address, "generate", req("after"), GenerateOutput))) == 3
    await healthy.aclose()


# ---------------------------------------------------------------- loss, duplicates, death


def drop_next(link, subject_prefix: str) -> list[str]:
    """Make `link` lose its next message to `subject_prefix` (as NATS does on a reconnect)."""
    dropped: list[str] = []
    publish = link.publish

    def lossy(subject, data, reply, **kw):
        if not dropped and subject.startswith(subject_prefix):
            dropped.append(subject)
            return
        publish(subject, data, reply, **kw)

    link.publish = lossy
    return dropped


async def test_a_lost_batch_to_the_server_ends_the_pairs_streams_on_both_sides(served, client):
    server, handlers = served
    stream = client.stream(server.address, "hang", req("lost"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(stream)
    dropped = drop_next(client._mailbox.link, server._mailbox.prefix)  # the next heartbeat
    with pytest.raises(PeerDisconnected, match="lost frames"):
        async with asyncio.timeout(5):
            await anext(stream)
    assert dropped and handlers.finalized == {"lost": True}  # the handler was cancelled: the engine aborts
    assert len(await collect(client.stream(server.address, "generate", req("after"), GenerateOutput))) == 3


async def test_a_lost_batch_to_the_client_ends_the_pairs_streams_on_both_sides(served, client):
    server, handlers = served
    stream = client.stream(server.address, "hang", req("lost"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(stream)
    dropped = drop_next(server._mailbox.link, client._mailbox.prefix)  # the server's next heartbeat
    with pytest.raises(PeerDisconnected, match="were lost"):
        async with asyncio.timeout(5):
            await anext(stream)
    await until(lambda: "lost" in handlers.finalized, "the handler cancelled")
    assert dropped and handlers.finalized == {"lost": True}
    assert len(await collect(client.stream(server.address, "generate", req("after"), GenerateOutput))) == 3


async def test_a_lost_last_batch_is_noticed_within_a_heartbeat(served, client):
    """A stream's END lost: the client's ping is answered, and the answer's number shows the gap."""
    server, _ = served
    await collect(client.stream(server.address, "generate", req("warm", n=1), GenerateOutput))
    dropped = drop_next(server._mailbox.link, client._mailbox.prefix)  # the chunk and END, in one batch
    started = time.monotonic()
    with pytest.raises(PeerDisconnected, match="were lost"):
        await collect(client.stream(server.address, "generate", req("tail", n=1), GenerateOutput))
    assert dropped and time.monotonic() - started < request_plane_nats.PEER_TIMEOUT_S


async def test_a_replayed_batch_is_not_served_twice(served, nats_url, caplog, warnings_all):
    server, handlers = served
    peer = await RawPeer.connect(nats_url)
    try:
        batch = Batch(sender=peer.prefix, seq=1, frames=[
            Frame(kind=REQUEST, stream_id=1, endpoint="generate", payload=msgspec.msgpack.encode(req("once", n=1)))])
        with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
            await peer.send(server, batch)
            await peer.send(server, batch)
            await until(lambda: any("a duplicate or a replay" in r.getMessage() for r in caplog.records),
                        "the replay dropped")
            # The first copy's handler runs on its own task: under load it can record after the replay's drop.
            await until(lambda: handlers.handled, "the first copy served")
        assert handlers.handled == ["once"]
    finally:
        await peer.nc.close()


CHILD_CLIENT = """
import asyncio, sys
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime.request_plane_nats import NatsRequestPlaneClient

async def main():
    c = NatsRequestPlaneClient(sys.argv[1])
    r = GenerateRequest(request_id=sys.argv[3], model="m", token_ids=[1], stop=StopConditions(max_tokens=1))
    stream = c.stream(sys.argv[2], "hang", r, GenerateOutput)
    await anext(stream)
    print("streaming", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_client_has_its_streams_cancelled_on_the_server(served, nats_url, python_child):
    """A frontend killed mid-request: the worker's next heartbeat finds no subscriber; the handler is
    cancelled (the engine request aborted) at once, not after the silence timeout."""
    server, handlers = served
    proc, line = await python_child(CHILD_CLIENT, nats_url, server.address, "orphan")
    assert line == "streaming"
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    await until(lambda: "orphan" in handlers.finalized, "the orphan's handler cancelled")
    assert handlers.finalized == {"orphan": True} and server.inflight == 0
    assert time.monotonic() - killed < request_plane_nats.PEER_TIMEOUT_S


CHILD_SERVER = """
import asyncio, sys
from turbine.protocol.generate import GenerateOutput, GenerateRequest
from turbine.runtime.request_plane_nats import NatsRequestPlaneServer

async def hang(r, ctx):
    yield GenerateOutput(token_ids=[0])
    await asyncio.Event().wait()

async def main():
    s = NatsRequestPlaneServer(sys.argv[1])
    s.register("hang", GenerateRequest, hang)
    await s.start()
    print(s.address, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_hung_server_ends_its_streams_after_the_silence_timeout(client, nats_url, python_child, monkeypatch):
    """A worker that stops answering but keeps its NATS subscription (stopped, or its loop stuck)."""
    monkeypatch.setattr(request_plane_nats, "PEER_TIMEOUT_S", 1.5)
    proc, address = await python_child(CHILD_SERVER, nats_url)
    stream = client.stream(address, "hang", req("stuck"), GenerateOutput)
    async with asyncio.timeout(10):
        await anext(stream)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(PeerDisconnected, match="nothing from it in 1.5s"):
            async with asyncio.timeout(5):
                await anext(stream)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


async def test_streams_across_a_nats_server_restart(tmp_path: Path):
    """The NATS server restarted under an open stream: it either goes on whole and in order (nats-py
    keeps what it publishes while reconnecting) or ends with PeerDisconnected (what was lost shows as a
    gap, or nothing came in time); it never hangs or skips. The handler ends either way, and the same
    server and client serve new streams once the connections are back."""
    nats_server = NatsServer(tmp_path / "nats.log")
    nats_server.start()
    server = client = None
    try:
        server, handlers = await serving(nats_server.url)
        client = NatsRequestPlaneClient(nats_server.url, auth=ClusterAuth())
        stream = client.stream(server.address, "slow", req("across", n=40), GenerateOutput)
        got = []
        async with asyncio.timeout(5):
            got.append((await anext(stream)).token_ids[0])
        nats_server.stop()
        await asyncio.sleep(0.5)
        nats_server.start()
        try:
            async with asyncio.timeout(request_plane_nats.PEER_TIMEOUT_S + 10):
                async for out in stream:
                    got.append(out.token_ids[0])
            assert got == list(range(40))
        except PeerDisconnected:
            assert got == list(range(len(got)))
        await until(lambda: "across" in handlers.finalized, "its handler ended", timeout=15)

        async def served_again() -> bool:
            try:
                return len(await collect(client.stream(server.address, "generate", req("again"), GenerateOutput))) == 3
            except (ConnectFailed, PeerDisconnected):
                return False

        async with asyncio.timeout(15):
            while not await served_again():
                await asyncio.sleep(0.2)
    finally:
        if client is not None:
            await client.close()
        if server is not None:
            await server.stop()
        nats_server.stop()


# ---------------------------------------------------------------- size


async def test_a_request_too_large_for_the_nats_server_names_its_max_payload(served, client):
    server, handlers = served
    with pytest.raises(FrameTooLarge, match="max_payload"):
        await anext(client.stream(server.address, "generate", req("huge", ids=list(range(400_000))), GenerateOutput))
    with pytest.raises(RemoteError, match="max_payload"):  # an answer too large: the stream's error says why
        await collect(client.stream(server.address, "big", req("big"), GenerateOutput))
    assert handlers.handled == []  # the huge request never left


# ---------------------------------------------------------------- the cluster key


async def test_the_same_key_serves_and_batches_are_signed(nats_url):
    server, handlers = await serving(nats_url, ClusterAuth(KEY))
    client = NatsRequestPlaneClient(nats_url, auth=ClusterAuth(KEY))
    seen: list[bytes] = []
    tap = await nats.connect(nats_url)
    try:
        async def tapped(msg):
            seen.append(msg.data)

        await tap.subscribe(f"{server._mailbox.prefix}.in", cb=tapped)
        await tap.flush()
        assert len(await collect(client.stream(server.address, "generate", req("keyed"), GenerateOutput))) == 3
        assert seen and all(ClusterAuth(KEY).verified_batch(f"{server._mailbox.prefix}.in".encode(), m) for m in seen)
        assert not any(ClusterAuth(OTHER_KEY).verified_batch(f"{server._mailbox.prefix}.in".encode(), m) for m in seen)
    finally:
        await tap.close()
        await client.close()
        await server.stop()


@pytest.mark.parametrize("client_key", [OTHER_KEY, None], ids=["wrong-key", "no-key"])
async def test_a_client_without_the_key_is_refused_before_decoding_and_logged(nats_url, client_key, caplog,
                                                                              warnings_all, monkeypatch):
    """Its batches are dropped unread (logged) and answered with why: it fails at once with ConnectFailed
    (the frontend tries another worker), as a TCP client fails the handshake."""
    server, handlers = await serving(nats_url, ClusterAuth(KEY))
    client = NatsRequestPlaneClient(nats_url, auth=ClusterAuth(client_key))
    decoded = []
    decode = request_plane_nats.codec.decode
    monkeypatch.setattr(request_plane_nats.codec, "decode",
                        lambda data, type_: (decoded.append(type_), decode(data, type_))[1])
    try:
        with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
            with pytest.raises(ConnectFailed, match="refused .* cluster-key signature"):
                await collect(client.stream(server.address, "generate", req("intruder"), GenerateOutput))
        assert any("wrong or missing cluster-key signature" in r.getMessage() for r in caplog.records)
        assert handlers.handled == [] and Batch not in decoded and server.inflight == 0
    finally:
        await client.close()
        await server.stop()


async def test_a_server_without_the_key_cannot_serve_a_keyed_client(nats_url):
    """A keyless server cannot read a keyed client's batches (and says so); nothing is handled."""
    server, handlers = await serving(nats_url, ClusterAuth())
    client = NatsRequestPlaneClient(nats_url, auth=ClusterAuth(KEY))
    try:
        with pytest.raises(ConnectFailed, match="refused .* undecodable"):
            await collect(client.stream(server.address, "generate", req("r"), GenerateOutput))
        assert handlers.handled == []
    finally:
        await client.close()
        await server.stop()


async def test_a_forged_answer_is_not_believed(nats_url, caplog, warnings_all):
    """The client checks what comes to it too: an unsigned END in the server's name is dropped, and the
    stream goes on."""
    server, handlers = await serving(nats_url, ClusterAuth(KEY))
    client = NatsRequestPlaneClient(nats_url, auth=ClusterAuth(KEY))
    peer = await RawPeer.connect(nats_url)
    try:
        stream = client.stream(server.address, "hang", req("victim"), GenerateOutput)
        async with asyncio.timeout(5):
            await anext(stream)
        forged = Batch(sender=server._mailbox.prefix, seq=99, frames=[Frame(kind=END, stream_id=1)])
        with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
            await peer.nc.publish(client._mailbox.inbox, msgspec.msgpack.encode(forged))
            await peer.nc.flush()
            await until(lambda: any(client._mailbox.inbox in r.getMessage() and "signature" in r.getMessage()
                                    for r in caplog.records), "the forgery dropped")
        await asyncio.sleep(2 * request_plane_nats.HEARTBEAT_S)
        assert not stream._finished and server.inflight == 1  # still streaming
        await stream.aclose()
    finally:
        await peer.nc.close()
        await client.close()
        await server.stop()


async def test_a_stale_signed_batch_is_dropped(nats_url, caplog, warnings_all):
    """A signed batch replayed after the server could have forgotten its sender: too old."""
    server, handlers = await serving(nats_url, ClusterAuth(KEY))
    peer = await RawPeer.connect(nats_url)
    try:
        subject = f"{server._mailbox.prefix}.in"
        batch = Batch(sender=peer.prefix, seq=1, sent_at=time.time() - 3600, frames=[
            Frame(kind=REQUEST, stream_id=1, endpoint="generate", payload=msgspec.msgpack.encode(req("old")))])
        with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
            await peer.send(server, ClusterAuth(KEY).sign_batch(subject.encode(), msgspec.msgpack.encode(batch)))
            await until(lambda: any("a replay, or clocks apart" in r.getMessage() for r in caplog.records),
                        "the stale batch dropped")
        assert handlers.handled == []
    finally:
        await peer.nc.close()
        await server.stop()


async def test_cancel_frames_reach_the_server(served, client):
    """aclose() sends a CANCEL in the next batch; the handler is cancelled."""
    server, handlers = served
    stream = client.stream(server.address, "hang", req("c"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(stream)
    sent: list[Batch] = []
    link = client._mailbox.link
    publish = link.publish
    link.publish = lambda subject, data, reply, **kw: (sent.append(msgspec.msgpack.decode(data, type=Batch)),
                                                       publish(subject, data, reply, **kw))[1]
    await stream.aclose()
    await until(lambda: "c" in handlers.finalized, "the handler cancelled")
    assert handlers.finalized == {"c": True}
    assert any(f.kind == CANCEL for b in sent for f in b.frames)

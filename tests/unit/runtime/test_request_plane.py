"""The request plane's behaviour, the same test cases on both planes (TCP and NATS: the `plane`
parameter of the `server` and `client` fixtures, with the real nats-server the tests use); what only
one plane has (bytes on a socket, messages on a subject) is tested on that plane below."""

import asyncio
import logging
import os
import signal
import socket
import struct
import time
import uuid

import msgspec
import pytest

from turbine.protocol.discovery import InstanceRecord
from turbine.protocol.frames import CHUNK, END, REQUEST, Frame
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.protocol import errors as codes
from turbine.protocol.errors import WorkerError
from turbine.runtime.errors import ConnectFailed, InvalidRequest, PeerDisconnected, RemoteError, RequestFailed
from turbine.runtime.request_plane import (
    RequestPlaneClient,
    RequestPlaneServer,
    StreamContext,
    encode_frame,
)
from turbine.runtime.request_plane_nats import NatsRequestPlaneClient, NatsRequestPlaneServer

# pyproject runs async fixtures on the session loop; run these tests on it too.
pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_FRAME = 1 << 20


def req(rid: str, n: int = 3, first: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", token_ids=[first], stop=StopConditions(max_tokens=n))


class Handlers:
    """Endpoints under test; records what happened to each stream on the server side."""

    def __init__(self) -> None:
        self.finalized: dict[str, bool] = {}  # request_id -> ctx.cancelled seen in `finally`
        self.finally_ran = asyncio.Event()
        self.lockstep = asyncio.Barrier(1)
        self.server: RequestPlaneServer | None = None
        self.inflight_in_finally: list[int] = []

    async def generate(self, r: GenerateRequest, ctx: StreamContext):
        for i in range(r.stop.max_tokens or 0):
            yield GenerateOutput(token_ids=[r.token_ids[0], i])
            await asyncio.sleep(0)  # let other streams interleave

    async def lockstep_gen(self, r: GenerateRequest, ctx: StreamContext):
        # Every stream must reach each step before any goes on: only possible if all
        # streams run concurrently over the shared connection.
        for i in range(3):
            yield GenerateOutput(token_ids=[r.token_ids[0], i])
            await self.lockstep.wait()

    async def hang(self, r: GenerateRequest, ctx: StreamContext):
        try:
            yield GenerateOutput(token_ids=[0])
            await asyncio.Event().wait()
        finally:
            self.finalized[r.request_id] = ctx.cancelled
            self.finally_ran.set()

    async def flood(self, r: GenerateRequest, ctx: StreamContext):
        # Never awaits: the server task only suspends when the socket pushes back.
        try:
            while True:
                yield GenerateOutput(token_ids=list(range(20_000)))
        finally:
            self.inflight_in_finally.append(self.server.inflight)

    async def boom(self, r: GenerateRequest, ctx: StreamContext):
        yield GenerateOutput(token_ids=[1])
        raise ValueError("kaput")

    async def big(self, r: GenerateRequest, ctx: StreamContext):
        yield GenerateOutput(token_ids=list(range(400_000)))

    async def refuse(self, r: GenerateRequest, ctx: StreamContext):
        yield GenerateOutput(token_ids=[1])
        raise RequestFailed("draining", code=codes.SHUTTING_DOWN)

    async def invalid(self, r: GenerateRequest, ctx: StreamContext):
        raise InvalidRequest("token_ids is empty")
        yield  # an async generator


@pytest.fixture
async def handlers():
    return Handlers()


PLANES = ["tcp", "nats"]


def new_server(plane: str, nats_url: str, **kw) -> RequestPlaneServer:
    if plane == "nats":
        return NatsRequestPlaneServer(nats_url, max_frame_bytes=MAX_FRAME, **kw)
    return RequestPlaneServer(max_frame_bytes=MAX_FRAME, **kw)


def new_client(plane: str, nats_url: str) -> RequestPlaneClient:
    if plane == "nats":
        return NatsRequestPlaneClient(nats_url, max_frame_bytes=MAX_FRAME, connect_timeout=2.0)
    return RequestPlaneClient(max_frame_bytes=MAX_FRAME, connect_timeout=2.0)


@pytest.fixture(params=PLANES)
def plane(request) -> str:
    return request.param


@pytest.fixture
async def server(handlers, plane, nats_url):
    srv = new_server(plane, nats_url)
    srv.register("generate", GenerateRequest, handlers.generate)
    srv.register("lockstep", GenerateRequest, handlers.lockstep_gen)
    srv.register("hang", GenerateRequest, handlers.hang)
    srv.register("boom", GenerateRequest, handlers.boom)
    srv.register("big", GenerateRequest, handlers.big)
    srv.register("flood", GenerateRequest, handlers.flood)
    srv.register("refuse", GenerateRequest, handlers.refuse)
    srv.register("invalid", GenerateRequest, handlers.invalid)
    handlers.server = srv
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client(plane, nats_url):
    c = new_client(plane, nats_url)
    yield c
    await c.close()


async def collect(stream) -> list:
    async with asyncio.timeout(5):
        return [item async for item in stream]


async def wait_until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
async def tcp_server(handlers, nats_url):
    """For what only the TCP plane has (bytes on a socket)."""
    async for srv in server.__wrapped__(handlers, "tcp", nats_url):
        yield srv


@pytest.fixture
async def tcp_client(nats_url):
    async for c in client.__wrapped__("tcp", nats_url):
        yield c


# ---------------------------------------------------------------- streaming


async def test_round_trip(server, client):
    items = await collect(client.stream(server.address, "generate", req("a", n=4, first=9), GenerateOutput))
    assert items == [GenerateOutput(token_ids=[9, i]) for i in range(4)]
    assert server.inflight == 0


async def test_many_streams_multiplexed_on_one_connection(server, client, handlers):
    n = 40
    handlers.lockstep = asyncio.Barrier(n)
    streams = [client.stream(server.address, "lockstep", req(str(i), first=i), GenerateOutput) for i in range(n)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, items in enumerate(results):
        assert items == [GenerateOutput(token_ids=[i, step]) for step in range(3)]
    assert len(server._connections) == 1


async def test_frames_sent_in_one_loop_turn_leave_in_one_write(server, client, plane):
    """TCP: one system call; NATS: one message."""
    async def burst(r: GenerateRequest, ctx: StreamContext):
        for i in range(50):
            yield GenerateOutput(token_ids=[i])  # no await: all 50 chunks and the end in one turn

    server.register("burst", GenerateRequest, burst)
    await collect(client.stream(server.address, "generate", req("connect", n=1), GenerateOutput))
    writes = []
    if plane == "tcp":
        [conn] = server._connections
        write = conn._transport.write
        conn._transport.write = lambda data: (writes.append(len(data)), write(data))[1]
    else:
        link = server._mailbox.link  # (this process's client shares it: only the server's messages count)
        publish, mine = link.publish, f"{server._mailbox.prefix}."
        link.publish = lambda subject, data, reply, **kw: (reply.startswith(mine) and writes.append(len(data)),
                                                           publish(subject, data, reply, **kw))[1]
    items = await collect(client.stream(server.address, "burst", req("b"), GenerateOutput))
    assert items == [GenerateOutput(token_ids=[i]) for i in range(50)]
    assert len(writes) == 1  # not 51


async def test_interleaved_generate_streams_keep_their_own_chunks(server, client):
    results = await asyncio.gather(
        *(collect(client.stream(server.address, "generate", req(str(i), n=50, first=i), GenerateOutput)) for i in range(20))
    )
    for i, items in enumerate(results):
        assert [o.token_ids for o in items] == [[i, k] for k in range(50)]


async def test_aclose_sends_cancel_and_handler_finally_runs(server, client, handlers):
    stream = client.stream(server.address, "hang", req("c"), GenerateOutput)
    other = client.stream(server.address, "hang", req("other"), GenerateOutput)
    async with asyncio.timeout(5):
        assert await anext(stream) == GenerateOutput(token_ids=[0])
        await anext(other)
    assert server.inflight == 2
    await stream.aclose()
    await wait_until(lambda: "c" in handlers.finalized)
    assert handlers.finalized["c"] is True  # ctx.cancelled was set
    # Only that stream was cancelled: the other one is still running on the connection.
    assert server.inflight == 1 and "other" not in handlers.finalized
    assert not await server.drain(timeout=0.05)
    await other.aclose()
    assert await server.drain(timeout=5)


async def test_cancel_under_backpressure_finishes_handler_before_stream_ends(server, client, handlers):
    stream = client.stream(server.address, "flood", req("f"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(stream)
    await stream.aclose()
    assert await server.drain(timeout=5)
    # The handler's cleanup ran inside the stream's task: once drain() returns, every
    # handler `finally` (e.g. an engine abort) has completed.
    assert handlers.inflight_in_finally == [1]


async def test_client_disconnect_cancels_all_its_handlers(server, client, handlers):
    streams = [client.stream(server.address, "hang", req(f"d{i}"), GenerateOutput) for i in range(3)]
    async with asyncio.timeout(5):
        for s in streams:
            await anext(s)
    assert server.inflight == 3
    await client.close()
    assert await server.drain(timeout=5)
    assert handlers.finalized == {"d0": True, "d1": True, "d2": True}


async def test_server_stop_fails_open_streams_promptly_and_pool_reconnects(server, client, handlers, plane,
                                                                           nats_url):
    streams = [client.stream(server.address, "hang", req(f"s{i}"), GenerateOutput) for i in range(5)]
    async with asyncio.timeout(5):
        for s in streams:
            await anext(s)
    port = getattr(server, "port", None)
    await server.stop()
    start = time.monotonic()
    for s in streams:
        with pytest.raises(PeerDisconnected):
            async with asyncio.timeout(2):
                await anext(s)
    assert time.monotonic() - start < 1.0

    # A new server (TCP: on the same address, so the dropped connection is replaced, not reused).
    again = RequestPlaneServer(port=port) if plane == "tcp" else new_server(plane, nats_url)
    again.register("generate", GenerateRequest, handlers.generate)
    await again.start()
    try:
        items = await collect(client.stream(again.address, "generate", req("after", n=2), GenerateOutput))
        assert len(items) == 2
    finally:
        await again.stop()


async def test_server_stop_with_an_error_ends_open_streams_with_it(server, client, handlers):
    """A worker past its shutdown grace period ends what is still running with shutting_down
    (which the frontend migrates), and each handler still runs its cleanup."""
    streams = [client.stream(server.address, "hang", req(f"g{i}"), GenerateOutput) for i in range(2)]
    async with asyncio.timeout(5):
        for s in streams:
            await anext(s)
    await server.stop(WorkerError.of(codes.SHUTTING_DOWN, "grace period over"))
    for s in streams:
        with pytest.raises(RemoteError) as info:
            async with asyncio.timeout(2):
                await anext(s)
        assert info.value.code == codes.SHUTTING_DOWN and info.value.error.retryable
    assert handlers.finalized == {"g0": True, "g1": True}


CHILD_SERVER = """
import asyncio, sys
from turbine.protocol.generate import GenerateOutput, GenerateRequest
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.request_plane_nats import NatsRequestPlaneServer

async def hang(r, ctx):
    yield GenerateOutput(token_ids=[0])
    await asyncio.Event().wait()

async def main():
    s = RequestPlaneServer() if sys.argv[1] == "tcp" else NatsRequestPlaneServer(sys.argv[2])
    s.register("hang", GenerateRequest, hang)
    await s.start()
    print(s.address, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_server_process_killed_gives_peer_disconnected_on_all_streams(client, python_child, plane, nats_url):
    proc, address = await python_child(CHILD_SERVER, plane, nats_url)
    streams = [client.stream(address, "hang", req(f"k{i}"), GenerateOutput) for i in range(5)]
    async with asyncio.timeout(10):
        for s in streams:
            await anext(s)
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    for s in streams:
        with pytest.raises(PeerDisconnected):
            async with asyncio.timeout(3):
                await anext(s)
    assert time.monotonic() - start < 1.5
    proc.wait()
    # TCP: the pool dropped the dead connection, the next stream tries a fresh connect; NATS: nobody
    # subscribes to its subject. Either way nothing was served: ConnectFailed.
    with pytest.raises(ConnectFailed):
        await anext(client.stream(address, "hang", req("late"), GenerateOutput))


# ---------------------------------------------------------------- errors


async def test_handler_exception_is_remote_error_and_server_keeps_serving(server, client):
    stream = client.stream(server.address, "boom", req("b"), GenerateOutput)
    async with asyncio.timeout(5):
        assert await anext(stream) == GenerateOutput(token_ids=[1])
        with pytest.raises(RemoteError, match="ValueError: kaput"):
            await anext(stream)
    assert len(await collect(client.stream(server.address, "generate", req("ok"), GenerateOutput))) == 3


async def test_unknown_endpoint_is_remote_error(server, client):
    with pytest.raises(RemoteError, match="unknown endpoint 'nope'") as failed:
        await collect(client.stream(server.address, "nope", req("u"), GenerateOutput))
    assert failed.value.code == codes.UNKNOWN_ENDPOINT


async def test_handler_failures_arrive_typed(server, client):
    """A handler's RequestFailed reaches the caller as a struct (code, message, retryable);
    any other exception as INTERNAL, not retryable."""
    with pytest.raises(RemoteError) as failed:
        await collect(client.stream(server.address, "refuse", req("r"), GenerateOutput))
    assert failed.value.error == WorkerError(code=codes.SHUTTING_DOWN, message="draining", retryable=True)
    with pytest.raises(RemoteError) as failed:
        await collect(client.stream(server.address, "invalid", req("i"), GenerateOutput))
    assert failed.value.error == WorkerError(code=codes.INVALID_REQUEST, message="token_ids is empty",
                                             retryable=False)
    with pytest.raises(RemoteError) as failed:
        await collect(client.stream(server.address, "boom", req("b"), GenerateOutput))
    assert (failed.value.code, failed.value.error.retryable) == (codes.INTERNAL, False)


async def test_undecodable_request_payload_is_remote_error_naming_field(server, client):
    wrong = InstanceRecord(namespace="n", component="c", endpoint="e", instance_id="i", address="a")
    with pytest.raises(RemoteError, match="missing required field `request_id`"):
        await collect(client.stream(server.address, "generate", wrong, GenerateOutput))


async def test_oversized_chunk_is_remote_error(server, client):
    with pytest.raises(RemoteError, match="FrameTooLarge"):
        await collect(client.stream(server.address, "big", req("big"), GenerateOutput))


def closed_port() -> int:
    """A local port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nobody_there(plane: str) -> str:
    """An address on `plane` that nothing serves."""
    if plane == "tcp":
        return f"127.0.0.1:{closed_port()}"
    return f"nats://127.0.0.1:4222/turbine.rpc.{uuid.uuid4().hex}"


async def test_connect_failed(client, plane):
    stream = client.stream(nobody_there(plane), "generate", req("x"), GenerateOutput)
    with pytest.raises(ConnectFailed):
        async with asyncio.timeout(5):
            await anext(stream)
    with pytest.raises(ConnectFailed, match="invalid"):
        await anext(client.stream("no-port-here" if plane == "tcp" else "nats://127.0.0.1:4222/elsewhere",
                                  "generate", req("x"), GenerateOutput))


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
        pytest.param(struct.pack(">I", MAX_FRAME + 1), id="oversized-length"),
        pytest.param(struct.pack(">I", 1) + b"\xc1", id="undecodable-msgpack"),
        pytest.param(struct.pack(">I", 3) + msgspec.msgpack.encode([1, 2]), id="not-a-frame"),
    ],
)
async def test_bad_bytes_close_only_that_connection(tcp_server, tcp_client, garbage, caplog):
    server, client = tcp_server, tcp_client
    # A healthy stream on another connection must survive the bad peer.
    healthy = client.stream(server.address, "hang", req("healthy"), GenerateOutput)
    async with asyncio.timeout(5):
        await anext(healthy)

    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    with caplog.at_level(logging.WARNING, logger="turbine.request_plane"):
        writer.write(garbage)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # the server closed it
    writer.close()
    assert any("closing request-plane connection" in r.getMessage() for r in caplog.records)

    assert server.inflight == 1  # the healthy stream is untouched
    items = await collect(client.stream(server.address, "generate", req("after"), GenerateOutput))
    assert len(items) == 3
    await healthy.aclose()


async def test_raw_frames_on_the_wire(tcp_server):
    server = tcp_server
    """The documented wire format: 4-byte big-endian length + msgpack Frame."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    payload = msgspec.msgpack.encode(req("raw", n=1, first=4))
    writer.write(bytes(encode_frame(Frame(kind=REQUEST, stream_id=7, endpoint="generate", payload=payload), MAX_FRAME)))
    frames = []
    async with asyncio.timeout(5):
        while len(frames) < 2:
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            frames.append(msgspec.msgpack.decode(await reader.readexactly(size), type=Frame))
    writer.close()
    assert [(f.kind, f.stream_id) for f in frames] == [(CHUNK, 7), (END, 7)]
    assert msgspec.msgpack.decode(frames[0].payload, type=GenerateOutput) == GenerateOutput(token_ids=[4, 0])

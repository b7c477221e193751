"""Request plane: typed request -> stream-of-responses calls over TCP (over NATS:
request_plane_nats.py, the same server and stream classes on another transport).

Many streams are multiplexed on one connection per (client, server address). Wire format
and frame kinds are defined in `turbine.protocol.frames`. Both sides use asyncio Protocols
(no per-frame awaits on the read side) and write frames without awaiting a drain unless the
transport reports its buffer is full.

With a cluster key (turbine/runtime/cluster_auth.py) every connection first runs a mutual HMAC
handshake: until the peer has proved the key its bytes are only compared, never decoded. With
TLS files, connections are mutual TLS (under the handshake, if there is also a key).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable, Container
from typing import Any, Generic, NamedTuple, TypeVar

from turbine import tracing
from turbine.logging_setup import request_id_var
from turbine.protocol import errors as codes
from turbine.protocol.errors import WorkerError
from turbine.protocol.frames import CANCEL, CHUNK, END, ERROR, REQUEST, Frame
from turbine.runtime import cluster_auth, codec
from turbine.runtime.cluster_auth import (
    CLIENT_PROOF_BYTES,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    SERVER_HELLO_BYTES,
    SERVER_PROOF_BYTES,
    ClusterAuth,
    RateLimitedWarning,
)
from turbine.runtime.errors import (
    ConnectFailed,
    DecodeError,
    FrameTooLarge,
    PeerDisconnected,
    RemoteError,
    RequestFailed,
    RequestPlaneError,
)

logger = logging.getLogger("turbine.request_plane")
_warn_refused = RateLimitedWarning(logger)  # peers that fail the cluster-key handshake

# Frames waiting for the end of the loop turn are written at once past this size, so that a
# handler that never awaits still meets the transport's backpressure.
FLUSH_BYTES = 64 * 1024

DEFAULT_MAX_FRAME_BYTES = 32 << 20
_HEADER = struct.Struct(">I")
_MAX_ERROR_CHARS = 16 << 10  # keep error frames small whatever the exception text

T = TypeVar("T")
Handler = Callable[[Any, "StreamContext"], AsyncIterator[Any]]


# ---------------------------------------------------------------- framing


class FrameError(Exception):
    """The peer sent bytes that are not a valid frame; its connection must be closed."""


def encode_frame(frame: Frame, max_frame_bytes: int) -> bytearray:
    """Length-prefixed msgpack of `frame`, encoded in place behind the header (no concat)."""
    buf = bytearray(_HEADER.size)
    codec.encode_into(frame, buf, _HEADER.size)
    size = len(buf) - _HEADER.size
    if size > max_frame_bytes:
        raise FrameTooLarge(
            f"{frame.kind} frame of {size} bytes exceeds max_frame_bytes={max_frame_bytes}"
        )
    _HEADER.pack_into(buf, 0, size)
    return buf


class FrameReader:
    """Reassembles frames from arbitrary TCP read boundaries."""

    def __init__(self, max_frame_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[Frame]:
        """Append `data`; return the frames now complete. Raises FrameError on bad input."""
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos, end = 0, len(buf)
        with memoryview(buf) as view:
            while end - pos >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buf, pos)
                # Checked before the body arrives, so a bogus length never makes us buffer it.
                if size > self._max:
                    raise FrameError(f"frame length {size} exceeds max_frame_bytes={self._max}")
                start = pos + _HEADER.size
                if end - start < size:
                    break
                try:
                    frames.append(codec.decode(view[start : start + size], Frame))
                except DecodeError as exc:
                    raise FrameError(str(exc)) from None
                pos = start + size
        del buf[:pos]
        return frames

    def starts_with(self, prefix: bytes) -> bool:
        """Whether the bytes not yet made into frames start with `prefix`."""
        return self._buf.startswith(prefix)


def _enable_keepalive(transport: asyncio.BaseTransport) -> None:
    """Detect a peer host that vanished without closing the socket in ~11 s, not hours."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


# ---------------------------------------------------------------- server


class StreamContext:
    """Per-stream information handed to a handler."""

    __slots__ = ("stream_id", "endpoint", "cancelled", "traceparent", "tracestate")

    def __init__(self, stream_id: int, endpoint: str, traceparent: str = "", tracestate: str = "") -> None:
        self.stream_id = stream_id
        self.endpoint = endpoint
        self.traceparent = traceparent  # the caller's trace context (turbine/tracing.py), if it traces
        self.tracestate = tracestate
        # Set before the handler task is cancelled (client cancel or disconnect).
        self.cancelled = False


class _Endpoint(NamedTuple):
    request_type: type
    handler: Handler


class _ServerConnection(asyncio.Protocol):
    """One accepted client connection: demultiplexes frames into handler tasks."""

    def __init__(self, server: RequestPlaneServer) -> None:
        self._server = server
        self._reader = FrameReader(server.max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._streams: dict[int, tuple[asyncio.Task[None], StreamContext]] = {}
        # Not None while the transport's write buffer is over its high-water mark.
        self.blocked: asyncio.Future[None] | None = None
        # Frames sent during this turn of the event loop, written together at its end: a worker
        # streaming to one frontend sends a chunk per request per engine step, and one write
        # (one system call) for all of a step's chunks costs far less than one each.
        self._out: list[bytes] = []
        self._out_bytes = 0
        # With a cluster key: the peer's bytes until it proved the key (None once it has).
        self._unproven: bytearray | None = None
        self._nonce = b""
        self._handshake_timer: asyncio.TimerHandle | None = None

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; don't check the type.
        self._transport = transport  # type: ignore[assignment]
        self._peer = _peer_name(transport)
        _enable_keepalive(transport)
        self._server._connections.add(self)
        auth = self._server.auth
        if auth.enabled:
            self._unproven = bytearray()
            self._nonce, hello = auth.server_hello()
            transport.write(hello)  # type: ignore[attr-defined]
            self._handshake_timer = asyncio.get_running_loop().call_later(
                HANDSHAKE_TIMEOUT_S, self._refuse, f"no cluster-key proof within {HANDSHAKE_TIMEOUT_S:g}s")

    def data_received(self, data: bytes) -> None:
        if self._unproven is not None:
            data = self._check_proof(data)
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            self._drop(str(exc))
            return
        for frame in frames:
            kind = frame.kind
            if kind == REQUEST:
                if frame.stream_id in self._streams:
                    self._drop(f"duplicate stream_id {frame.stream_id}")
                    return
                self._open(frame)
            elif kind == CANCEL:
                self._cancel(frame.stream_id)
            else:
                logger.debug("ignoring %r frame from %s", kind, self._peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        for task, ctx in self._streams.values():
            ctx.cancelled = True
            task.cancel()
        self._streams.clear()
        self.resume_writing()  # nobody may stay blocked on a dead transport

    def pause_writing(self) -> None:
        self.blocked = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self.blocked = self.blocked, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # used by the server's stream tasks

    def send(self, frame: Frame) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if not self._out:
                asyncio.get_running_loop().call_soon(self._flush)
            data = encode_frame(frame, self._server.max_frame_bytes)
            self._out.append(data)
            self._out_bytes += len(data)
            if self._out_bytes >= FLUSH_BYTES:
                self._flush()  # the transport sees the data now, so it can push back (pause_writing)

    def _flush(self) -> None:
        out, self._out, self._out_bytes = self._out, [], 0
        transport = self._transport
        if out and transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))

    def fail_streams(self, error: WorkerError, endpoints: Container[str] | None = None) -> list[asyncio.Task]:
        """End every open stream (of `endpoints`, None: all) with `error` and cancel its handler
        (which frees its engine work); returns the handlers' tasks."""
        failed = []
        for stream_id, (task, ctx) in list(self._streams.items()):
            if endpoints is None or ctx.endpoint in endpoints:
                del self._streams[stream_id]
                _send_error(self, stream_id, error)
                ctx.cancelled = True
                task.cancel()
                failed.append(task)
        return failed

    def stream_done(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    def close(self) -> None:
        if self._transport is not None:
            self._flush()
            self._transport.close()

    # internals

    def _open(self, frame: Frame) -> None:
        ctx = StreamContext(frame.stream_id, frame.endpoint, frame.traceparent, frame.tracestate)
        task = self._server._spawn(self, ctx, frame.payload)
        self._streams[frame.stream_id] = (task, ctx)

    def _cancel(self, stream_id: int) -> None:
        entry = self._streams.pop(stream_id, None)
        if entry is not None:
            task, ctx = entry
            ctx.cancelled = True
            task.cancel()

    def _drop(self, reason: str) -> None:
        logger.warning("closing request-plane connection from %s: %s", self._peer, reason)
        assert self._transport is not None
        self._transport.abort()

    def _check_proof(self, data: bytes) -> bytes:
        """Collects the client's proof; once it is whole, checks it: answers with ours, or cuts
        the peer off. Returns the bytes that follow a good proof (frames), else b""."""
        unproven = self._unproven
        assert unproven is not None
        need = CLIENT_PROOF_BYTES - len(unproven)
        unproven += data[:need]  # never buffers more than a proof
        if len(unproven) < CLIENT_PROOF_BYTES:
            if not MAGIC.startswith(bytes(unproven[:len(MAGIC)])):
                self._refuse("it does not speak the cluster-key handshake (no --cluster-key?)")
            return b""
        answer = self._server.auth.check_client_proof(self._nonce, bytes(unproven))
        if answer is None:
            self._refuse("wrong cluster key" if unproven.startswith(MAGIC) else
                         "it does not speak the cluster-key handshake (no --cluster-key?)")
            return b""
        self._unproven = None
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        assert self._transport is not None
        self._transport.write(answer)
        return data[need:]

    def _refuse(self, reason: str) -> None:
        """Cut off a peer that did not prove the cluster key: nothing it sent was decoded."""
        if self._transport is None or self._transport.is_closing():
            return
        _warn_refused("request plane: refused %s, which failed the cluster-key handshake: %s", self._peer, reason)
        self._transport.abort()


class RequestPlaneServer:
    """Serves registered endpoints; each request runs its handler in its own task."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        auth: ClusterAuth | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.max_frame_bytes = max_frame_bytes
        self.auth = auth if auth is not None else cluster_auth.current()
        self._endpoints: dict[str, _Endpoint] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._tasks: dict[asyncio.Task[None], StreamContext] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        # Endpoints answered with a typed error instead of their handler (e.g. a sleeping worker's).
        self._refused: dict[str, WorkerError] = {}

    def register(self, endpoint: str, request_type: type, handler: Handler) -> None:
        """`handler(request, ctx)` returns an async iterator (normally an async generator)."""
        if endpoint in self._endpoints:
            raise ValueError(f"endpoint {endpoint!r} is already registered")
        self._endpoints[endpoint] = _Endpoint(request_type, handler)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ssl_ctx = self.auth.server_ssl()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), self.host, self.port, ssl=ssl_ctx,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if ssl_ctx is not None else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        """"host:port" as bound (a wildcard host is not a reachable address: advertise your own)."""
        if self._server is None:
            raise RuntimeError("server not started")
        return f"{self.host}:{self.port}"

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def inflight_on(self, endpoints: Container[str]) -> int:
        """Open streams of these endpoints."""
        return sum(ctx.endpoint in endpoints for ctx in self._tasks.values())

    async def drain_endpoints(self, endpoints: Container[str], timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until no stream of `endpoints` is open; False if `timeout` passed first. (The
        caller's own stream, e.g. a `sleep` request, is on another endpoint.)"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight_on(endpoints):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def fail_streams(self, endpoints: Container[str], error: WorkerError) -> int:
        """End every open stream of `endpoints` with `error` (its handler is cancelled, so its
        `finally` frees what it held); returns how many."""
        tasks = [task for conn in list(self._connections) for task in conn.fail_streams(error, endpoints)]
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    def refuse(self, endpoint: str, error: WorkerError | None) -> None:
        """Answer new streams of `endpoint` with `error` (None: serve them again)."""
        if error is None:
            self._refused.pop(endpoint, None)
        else:
            self._refused[endpoint] = error

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until no stream is open; False if `timeout` passed first."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self, error: WorkerError | None = None) -> None:
        """Stop listening, cancel open streams and close every connection. With `error`, each
        open stream ends with it first (e.g. shutting_down, so that the caller migrates the
        request) instead of just being cut off."""
        if self._server is not None:
            self._server.close()
        if error is not None:
            for conn in list(self._connections):
                conn.fail_streams(error)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _spawn(self, conn: _ServerConnection, ctx: StreamContext, payload: bytes) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._run(conn, ctx, payload))
        self._tasks[task] = ctx
        self._idle.clear()
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not self._tasks:
            self._idle.set()

    async def _run(self, conn: _ServerConnection, ctx: StreamContext, payload: bytes) -> None:
        sid = ctx.stream_id
        span = token = None
        try:
            endpoint = self._endpoints.get(ctx.endpoint)
            if (refusal := self._refused.get(ctx.endpoint)) is not None:
                _send_error(conn, sid, refusal)
                return
            if endpoint is None:
                known = ", ".join(sorted(self._endpoints)) or "none"
                _send_error(conn, sid, WorkerError.of(
                    codes.UNKNOWN_ENDPOINT, f"unknown endpoint {ctx.endpoint!r} (known: {known})"))
                return
            try:
                request = codec.decode(payload, endpoint.request_type)
            except DecodeError as exc:
                _send_error(conn, sid, WorkerError.of(codes.INVALID_REQUEST, f"DecodeError: {exc}"))
                return
            # Log lines about this request carry its id (this task's own context).
            request_id = getattr(request, "request_id", None)
            if request_id is not None:
                request_id_var.set(request_id)
            if tracing.tracer is not None:  # a span for the handler, a child of the caller's if it traces
                span = tracing.start(ctx.endpoint, tracing.extract(ctx.traceparent, ctx.tracestate), server=True,
                                     attributes={"turbine.request_id": request_id or ""})
                token = tracing.attach(span)
            items = endpoint.handler(request, ctx)
            try:
                async for item in items:
                    conn.send(Frame(kind=CHUNK, stream_id=sid, payload=codec.encode(item)))
                    if conn.blocked is not None:  # backpressure: the client reads slowly
                        await conn.blocked
            finally:
                # If we were cancelled outside the generator (e.g. waiting for the socket),
                # close it now so the handler's `finally` runs promptly, not at GC.
                aclose = getattr(items, "aclose", None)
                if aclose is not None:
                    await aclose()
            conn.send(Frame(kind=END, stream_id=sid))
        except asyncio.CancelledError:
            tracing.end(span, "cancelled")
            span = None
            raise  # the client cancelled or went away, or the server failed it (fail_streams): nothing to send
        except RequestFailed as exc:
            tracing.end(span, exc.error.code)
            span = None
            _send_error(conn, sid, exc.error)
        except Exception as exc:
            tracing.end(span, exc)
            span = None
            logger.warning("handler for %r stream %d failed", ctx.endpoint, sid, exc_info=True)
            _send_error(conn, sid, WorkerError.of(codes.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            tracing.detach(token)
            tracing.end(span)
            conn.stream_done(sid)


def _send_error(conn: _ServerConnection, stream_id: int, error: WorkerError) -> None:
    conn.send(Frame(kind=ERROR, stream_id=stream_id, error=error.message[:_MAX_ERROR_CHARS], code=error.code,
                    retryable=error.retryable, param=error.param or ""))


# ---------------------------------------------------------------- client


class _ClientConnection(asyncio.Protocol):
    """One pooled connection to a server; routes incoming frames to their streams."""

    def __init__(self, address: str, max_frame_bytes: int, on_lost: Callable[[_ClientConnection], None],
                 auth: ClusterAuth):
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.streams: dict[int, ResponseStream[Any]] = {}
        self.closed = False
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        # Done once the server proved the cluster key (at once without one); ConnectFailed if not.
        self.ready: asyncio.Future[None] = loop.create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it after a timeout
        self._reader = FrameReader(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._next_id = 1
        self._on_lost = on_lost
        self._auth = auth
        self._unproven: bytearray | None = bytearray() if auth.enabled else None
        self._nonces = b""  # set once we answered the server's hello
        self.failure = ""  # why we closed it, for streams opened meanwhile

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        _enable_keepalive(transport)
        if self._unproven is None:
            self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._unproven is not None:
            data = self._check_server(data)
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            if not self._auth.enabled and self._reader.starts_with(MAGIC):
                exc = FrameError("it requires a cluster key (give this process the same --cluster-key)")
            logger.warning("closing request-plane connection to %s: %s", self.address, exc)
            self.failure = str(exc)
            self.abort()
            return
        streams = self.streams
        for frame in frames:
            kind = frame.kind
            if kind == CHUNK:
                stream = streams.get(frame.stream_id)
            elif kind == END or kind == ERROR:
                stream = streams.pop(frame.stream_id, None)
            else:
                continue  # a kind from a newer peer
            # None: a stream we already cancelled; late frames are expected.
            if stream is not None:
                stream._push(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost(self)
        if not self.ready.done():
            self.ready.set_exception(ConnectFailed(
                f"{self.address} closed the connection during the cluster-key handshake: it has a different "
                f"cluster key, or none"))
        reason = f": {exc}" if exc else ""
        for stream in self.streams.values():
            stream._fail(PeerDisconnected(f"connection to {self.address} lost{reason}"))
        self.streams.clear()
        self.lost.set_result(None)

    def open_stream(self, stream: ResponseStream[Any], endpoint: str, payload: bytes,
                    trace: tracing.Carrier | None = None) -> int:
        stream_id = self._next_id
        frame = Frame(kind=REQUEST, stream_id=stream_id, endpoint=endpoint, payload=payload)
        if trace is not None:
            frame.traceparent, frame.tracestate = trace
        frame = encode_frame(frame, self.max_frame_bytes)
        self._next_id += 1
        self.streams[stream_id] = stream
        assert self._transport is not None
        self._transport.write(frame)
        return stream_id

    def cancel_stream(self, stream_id: int) -> None:
        if self.streams.pop(stream_id, None) is not None and not self.closed:
            assert self._transport is not None
            self._transport.write(encode_frame(Frame(kind=CANCEL, stream_id=stream_id), self.max_frame_bytes))

    def abort(self) -> None:
        self.closed = True  # no new streams on it, even before connection_lost runs
        if self._transport is not None:
            self._transport.abort()

    def _check_server(self, data: bytes) -> bytes:
        """The handshake, client side: answer the server's hello, then check its proof. Returns
        the bytes that follow it (frames), else b"". A server that fails is cut off."""
        unproven = self._unproven
        assert unproven is not None and self._transport is not None
        want = SERVER_PROOF_BYTES if self._nonces else SERVER_HELLO_BYTES
        need = want - len(unproven)
        unproven += data[:need]
        rest = data[need:]
        if len(unproven) < want:
            if not self._nonces and not MAGIC.startswith(bytes(unproven[:len(MAGIC)])):
                self._refuse("it does not speak the cluster-key handshake (no --cluster-key?)")
            return b""
        if not self._nonces:
            answer = self._auth.client_proof(bytes(unproven))
            if answer is None:
                self._refuse("it does not speak the cluster-key handshake (no --cluster-key?)")
                return b""
            self._nonces, proof = answer
            unproven.clear()
            self._transport.write(proof)
            return self._check_server(rest) if rest else b""
        if not self._auth.check_server_proof(self._nonces, bytes(unproven)):
            self._refuse("it failed to prove the cluster key")
            return b""
        self._unproven = None
        self.ready.set_result(None)
        return rest

    def _refuse(self, reason: str) -> None:
        _warn_refused("request plane: refused the server at %s: %s", self.address, reason)
        if not self.ready.done():
            self.ready.set_exception(ConnectFailed(f"{self.address} failed the cluster-key handshake: {reason}"))
        self.abort()


class ResponseStream(Generic[T]):
    """Async iterator over one call's responses. Also an async context manager (closes on exit).

    Raises ConnectFailed (first iteration), PeerDisconnected, RemoteError or DecodeError.
    Chunks received before a disconnect are still yielded before PeerDisconnected is raised.
    """

    def __init__(
        self, client: RequestPlaneClient, address: str, endpoint: str, payload: bytes, response_type: type[T],
        trace: tracing.Carrier | None = None,
    ) -> None:
        self._client = client
        self._trace = trace
        self._address = address
        self._endpoint = endpoint
        self._payload = payload
        self._response_type = response_type
        self._conn: _ClientConnection | None = None
        self._stream_id = 0
        self._frames: deque[Frame] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._failure: RequestPlaneError | None = None
        self._finished = False  # end/error seen, failed, or closed by the caller

    def __aiter__(self) -> ResponseStream[T]:
        return self

    @property
    def buffered(self) -> int:
        """Frames received and not yet taken: that many next() calls return without waiting."""
        return len(self._frames)

    async def __anext__(self) -> T:
        if self._conn is None and not self._finished:
            try:
                await self._open()
            except BaseException:
                self._finished = True
                raise
        frames = self._frames
        while not frames:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        frame = frames.popleft()
        if frame.kind == CHUNK:
            try:
                return codec.decode(frame.payload, self._response_type)
            except DecodeError:
                await self.aclose()
                raise
        if frame.kind == END:
            raise StopAsyncIteration
        raise RemoteError(WorkerError(code=frame.code or codes.INTERNAL, message=frame.error,
                                      retryable=frame.retryable, param=frame.param or None))

    async def aclose(self) -> None:
        """Abandon the stream; if it is still open, the server's handler is cancelled."""
        if self._finished:
            return
        self._finished = True
        self._frames.clear()
        if self._conn is not None:
            self._conn.cancel_stream(self._stream_id)
        self._wake()

    async def __aenter__(self) -> ResponseStream[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _open(self) -> None:
        conn = await self._client._connection(self._address)
        if self._finished:  # closed while we were connecting
            return
        if conn.closed:  # e.g. what the server said first made us close it
            raise ConnectFailed(f"{self._address}: {conn.failure or 'connection closed'}")
        self._conn = conn
        self._stream_id = conn.open_stream(self, self._endpoint, self._payload, self._trace)

    # called by the connection

    def _push(self, frame: Frame) -> None:
        if frame.kind != CHUNK:
            self._finished = True
        self._frames.append(frame)
        self._wake()

    def _fail(self, failure: RequestPlaneError) -> None:
        self._finished = True
        self._failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class RequestPlaneClient:
    """Opens streams to request-plane servers over one lazily created connection per address."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = 3.0,
                 auth: ClusterAuth | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout = connect_timeout
        self.auth = auth if auth is not None else cluster_auth.current()
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}

    def stream(self, address: str, endpoint: str, request: Any, response_type: type[T],
               trace: tracing.Carrier | None = None) -> ResponseStream[T]:
        """Start a call; nothing is sent until the first iteration. `trace`: the caller's trace
        context (turbine/tracing.py), for the handler's spans to join."""
        return ResponseStream(self, address, endpoint, codec.encode(request), response_type, trace)

    async def close(self) -> None:
        """Close every pooled connection (open streams fail with PeerDisconnected)."""
        conns = list(self._conns.values())
        for conn in conns:
            conn.abort()
        await asyncio.gather(*(conn.lost for conn in conns))

    async def _connection(self, address: str) -> _ClientConnection:
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        # Streams that start together share one connect attempt.
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(lambda t: self._connect_done(address, t))
        return await asyncio.shield(task)

    def _connect_done(self, address: str, task: asyncio.Task[_ClientConnection]) -> None:
        if self._connecting.get(address) is task:
            del self._connecting[address]
        if not task.cancelled():
            task.exception()  # retrieved here so an unawaited failure is not logged as lost

    async def _connect(self, address: str) -> _ClientConnection:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ConnectFailed(f"invalid request-plane address {address!r} (want host:port)")
        loop = asyncio.get_running_loop()
        ssl_ctx = self.auth.client_ssl()
        conn: _ClientConnection | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(address, self.max_frame_bytes, self._forget, self.auth),
                    host.strip("[]"),
                    int(port),
                    ssl=ssl_ctx,
                )
                await conn.ready
        except TimeoutError:
            if conn is not None:  # connected, but no handshake
                conn.abort()
                raise ConnectFailed(f"{address} did not complete the cluster-key handshake within "
                                    f"{self.connect_timeout}s (does it run without a cluster key?)") from None
            raise ConnectFailed(f"cannot connect to {address}: timed out after {self.connect_timeout}s") from None
        except ssl.SSLError as exc:
            raise ConnectFailed(f"cannot connect to {address}: TLS: {exc}") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {address}: {exc}") from exc
        self._conns[address] = conn
        return conn

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]


# The clients that parts of a process make for themselves (a KV router fetching missed events) are on
# the process's request plane: its entry point installs the factory (RequestPlaneConfig.install).
_client_factory: Callable[..., RequestPlaneClient] = RequestPlaneClient


def install_client_factory(factory: Callable[..., RequestPlaneClient]) -> None:
    global _client_factory
    _client_factory = factory


def new_client(**kwargs: Any) -> RequestPlaneClient:
    """A client on this process's request plane (TCP unless its entry point installed another)."""
    return _client_factory(**kwargs)

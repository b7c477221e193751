"""The nats request-plane backend: the same calls as the TCP plane (request_plane.py: a typed
request in, a stream of typed responses out, cancel, typed errors), carried by a NATS server, for
sites that allow only NATS between hosts.

Every server and client is a mailbox on the subject prefix "turbine.rpc.<32 hex>": it subscribes to
"<prefix>.>", takes its messages on "<prefix>.in", and a server's address in discovery is
"nats://host:port/<prefix>" (a client sends through its own --nats-server: members of a NATS cluster
route subjects between them). The frames are the TCP plane's (turbine/protocol/frames.py); those one
side sends the other during one turn of its event loop travel as one NATS message, a `Batch`, so a
worker's engine step costs one message per frontend, not one per request.

What TCP gives for free is rebuilt here, per pair of peers:
- order and loss: batches are numbered; NATS keeps one connection's messages to a subject in order
  and drops them only on a reconnect or a slow consumer, which shows as a gap. The receiver of a gap
  ends every stream the pair had open (the client fails them with PeerDisconnected, which the frontend
  migrates; the server cancels their handlers, which aborts the engine requests) and says so in its
  next batch (`reset_below`). A replayed or duplicated batch (an old number) is dropped.
- peer death: every batch is published with a reply subject "<prefix>.gone.<k>", so when the peer's
  subscription is gone (its process died, its connection closed) the NATS server answers there at
  once ("no responders", status 503). While streams are open each side sends the other a heartbeat
  (an empty batch) every HEARTBEAT_S: a dead peer is seen within one, and a peer that sent nothing
  for PEER_TIMEOUT_S (hung, or cut off from NATS) ends its streams too. A request to a server with no
  subscription fails with ConnectFailed (nothing was served: the frontend tries another worker).
- size: NATS refuses a message over the server's `max_payload` (1 MiB unless configured): a frame
  that cannot fit fails with FrameTooLarge naming that limit, on either side.
- authentication: with a cluster key every batch carries a MAC (keyed BLAKE2b under a key derived for
  this use, with the destination subject mixed in: cluster_auth.py), checked before anything decodes
  it; a forged batch is dropped and logged. The batch's send time is inside it, so with a key a batch
  older than MAX_BATCH_AGE_S is dropped too (a replay after the receiver forgot its sender). A batch
  dropped unread is answered on its reply subject with a "Turbine-Refused" header saying why, so a peer
  with another key (or none) fails at once (ConnectFailed: the frontend tries another worker) instead
  of after its silence timeout. Those answers and the NATS server's "no responders" are unsigned: a
  peer on the NATS server may fake one, which fails streams (as it could by disconnecting them); never
  more. Not encrypted (use the NATS
  server's TLS); --tls-* is the TCP plane's.

Why not nats-py's request/reply or its `micro` services: one reply per request, no stream, no cancel,
no liveness; JetStream would persist what is only worth anything live.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Container
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from turbine.protocol.errors import WorkerError
from turbine.protocol.frames import CANCEL, CHUNK, END, ERROR, REQUEST, Batch, Frame
from turbine.runtime import codec
from turbine.runtime.cluster_auth import ClusterAuth, RateLimitedWarning
from turbine.runtime.errors import ConnectFailed, DecodeError, FrameTooLarge, PeerDisconnected, RequestPlaneError
from turbine.runtime.errors import EventPlaneError
from turbine.runtime.event_plane_nats import connect_nats, parse_server
from turbine.runtime.request_plane import (
    DEFAULT_MAX_FRAME_BYTES,
    RequestPlaneClient,
    RequestPlaneServer,
    ResponseStream,
    StreamContext,
    _send_error,
)

logger = logging.getLogger("turbine.request_plane")
_warn = RateLimitedWarning(logger)

SUBJECT_ROOT = "turbine.rpc"
_PREFIX = re.compile(r"^turbine\.rpc\.[0-9a-f]{32}$")
_GONE_SUBJECT = re.compile(r"^turbine\.rpc\.[0-9a-f]{32}\.gone\.[0-9]+$")
REFUSED_HEADER = "Turbine-Refused"
INBOX = "in"
GONE = "gone"
HEARTBEAT_S = 0.5
PEER_TIMEOUT_S = 10.0  # generous: a peer's event loop may stall for seconds on a loaded host
MAX_BATCH_AGE_S = 120.0  # with a cluster key; also how long a silent peer's numbering is remembered (x5)
# Room kept in a NATS message for the batch around the frames, the reply subject and the MAC.
BATCH_OVERHEAD = 512
FRAME_OVERHEAD = 64  # a frame's fields besides its payload and error text, at most (msgpack)
# Bytes queued for NATS beyond which a server's handlers wait (as a TCP transport's high-water mark).
HIGH_WATER_BYTES = 8 << 20
LOW_WATER_BYTES = 2 << 20


def is_nats_address(address: str) -> bool:
    return address.startswith("nats://")


def prefix_of(address: str) -> str:
    """A server's address "nats://host:port/<prefix>" -> its subject prefix; ConnectFailed if it is none."""
    prefix = address.partition("://")[2].partition("/")[2]
    if not _PREFIX.match(prefix):
        raise ConnectFailed(f"invalid NATS request-plane address {address!r} (want nats://HOST:PORT/{SUBJECT_ROOT}.<id>)")
    return prefix


def _too_large(size: int, limit: int, max_payload: int) -> FrameTooLarge:
    if limit + BATCH_OVERHEAD >= max_payload:
        return FrameTooLarge(f"a frame of about {size} bytes does not fit in a message of the NATS server's "
                             f"max_payload ({max_payload} bytes; raise max_payload in the nats-server configuration)")
    return FrameTooLarge(f"a frame of about {size} bytes exceeds max_frame_bytes={limit}")


# ---------------------------------------------------------------- the process's NATS connection


class NatsLink:
    """One process's connection to its NATS server for the request plane, shared by its servers and
    clients (reference-counted). `publish` never waits: messages queue and one task sends them in
    order; `blocked` is a future while the queue is over HIGH_WATER_BYTES."""

    _shared: dict[tuple[int, str], NatsLink] = {}
    _connecting: dict[tuple[int, str], asyncio.Lock] = {}

    def __init__(self, client: Client, server: str):
        self.server = server
        self.client = client
        self.refs = 0
        self._queue: deque[tuple[str, bytes, str, dict[str, str] | None]] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._sender = asyncio.get_running_loop().create_task(self._send_queued())
        self.blocked: asyncio.Future[None] | None = None
        self.dropped = 0

    @classmethod
    async def acquire(cls, server: str) -> NatsLink:
        """This process's link to `server` (connected now if it is the first); EventPlaneError if the
        server cannot be reached."""
        try:
            server = parse_server(server)
        except ValueError as exc:
            raise EventPlaneError(f"--nats-server: {exc}") from None
        key = (id(asyncio.get_running_loop()), server)
        async with cls._connecting.setdefault(key, asyncio.Lock()):  # parts of a process starting together
            link = cls._shared.get(key)
            if link is None or link.client.is_closed:
                try:
                    client = await connect_nats(server, "request plane")
                except EventPlaneError as exc:
                    raise EventPlaneError(f"--nats-server (request plane): {exc}") from None
                link = cls._shared[key] = cls(client, server)
                logger.info("request plane: NATS at %s", server)
            link.refs += 1
            return link

    async def release(self) -> None:
        self.refs -= 1
        if self.refs > 0:
            return
        for key, link in list(self._shared.items()):
            if link is self:
                del self._shared[key]
        for _ in range(100):  # what is queued goes out first
            if not self._queue or not self.client.is_connected:
                break
            await asyncio.sleep(0.01)
        self._sender.cancel()
        try:
            await asyncio.wait_for(self.client.drain(), 2)
        except Exception:  # closing anyway
            pass
        await self.client.close()

    @property
    def max_payload(self) -> int:
        return self.client.max_payload

    def publish(self, subject: str, data: bytes, reply: str, headers: dict[str, str] | None = None) -> None:
        self._queue.append((subject, data, reply, headers))
        self._queued_bytes += len(data)
        if self._queued_bytes > HIGH_WATER_BYTES and self.blocked is None:
            self.blocked = asyncio.get_running_loop().create_future()
        self._wake.set()

    async def _send_queued(self) -> None:
        queue, publish = self._queue, self.client.publish
        while True:
            await self._wake.wait()
            self._wake.clear()
            while queue:
                subject, data, reply, headers = queue.popleft()
                self._queued_bytes -= len(data)
                if self.blocked is not None and self._queued_bytes < LOW_WATER_BYTES:
                    blocked, self.blocked = self.blocked, None
                    if not blocked.done():
                        blocked.set_result(None)
                try:
                    await publish(subject, data, reply=reply, headers=headers)
                except Exception as exc:  # disconnected with a full buffer, closed...: the receiver sees a gap
                    self.dropped += 1
                    _warn("request plane: NATS %s: a message to %s was dropped (%s: %s); its streams end",
                          self.server, subject, type(exc).__name__, exc)


# ---------------------------------------------------------------- one side of a pair of peers


class _Peer:
    """What a mailbox keeps about one peer: the numbering both ways, when it was last heard from,
    and the frames for it that leave at the end of this loop turn."""

    __slots__ = ("prefix", "index", "sent", "expected", "heard", "reset_below", "out", "out_bytes", "state")

    def __init__(self, prefix: str, index: int):
        self.prefix = prefix
        self.index = index
        self.sent = 0  # the last batch number sent to it
        self.expected = 1  # the number its next batch should have
        self.heard = time.monotonic()
        self.reset_below = 0  # to tell it in the next batch
        self.out: list[Frame] = []
        self.out_bytes = 0
        self.state: Any = None  # the server's or the client's own per-peer state


class Mailbox:
    """A subject prefix on a NatsLink: receives batches (signature, numbering, liveness checked) and
    sends batches of frames to peers. The owner (a server or a client) implements `_has_streams(peer)`,
    `_on_batch(peer, batch)`, `_on_lost(peer, below)` (batches from the peer were lost: the streams
    opened in its batches numbered below `below` are gone), `_on_reset(peer, below)` (the peer lost
    batches from us: likewise, in our numbering) and `_on_gone(peer, why, no_subscriber)` (the peer is
    dead: nobody subscribes to its subject; or silent)."""

    # A server forgets a client idle for long (it comes back as new: a gap, which ends nothing open); a
    # client never forgets a server (a server that still numbered it would drop its batches as replays).
    forgets_idle_peers = False

    def __init__(self, link: NatsLink, auth: ClusterAuth, max_frame_bytes: int):
        self.link = link
        self.auth = auth
        self.prefix = f"{SUBJECT_ROOT}.{uuid.uuid4().hex}"
        self.inbox = f"{self.prefix}.{INBOX}"
        self._inbox_bytes = self.inbox.encode()
        self.limit = min(max_frame_bytes, link.max_payload - BATCH_OVERHEAD)
        self.peers: dict[str, _Peer] = {}
        self._by_index: dict[int, _Peer] = {}
        self._next_index = 0
        self._flush_soon: set[_Peer] = set()
        self._sub = None
        self._ticker: asyncio.Task | None = None

    async def open(self) -> None:
        self._sub = await self.link.client.subscribe(f"{self.prefix}.>", cb=self._received)
        await self.link.client.flush()  # the server has the subscription once this returns
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        self._flush_all()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is closing anyway
                pass

    # -- peers and sending ----------------------------------------------------------
    def peer(self, prefix: str) -> _Peer:
        peer = self.peers.get(prefix)
        if peer is None:
            self._next_index += 1
            peer = self.peers[prefix] = self._by_index[self._next_index] = _Peer(prefix, self._next_index)
        return peer

    def forget(self, peer: _Peer) -> None:
        self.peers.pop(peer.prefix, None)
        self._by_index.pop(peer.index, None)
        self._flush_soon.discard(peer)

    def send(self, peer: _Peer, frame: Frame) -> None:
        """Queue `frame` for `peer`, sent at the end of this loop turn (at once past the limit).
        FrameTooLarge if it cannot fit in one NATS message."""
        size = (len(frame.payload) + len(frame.error) + len(frame.endpoint) + len(frame.traceparent)
                + len(frame.tracestate) + FRAME_OVERHEAD)
        if size > self.limit:
            raise _too_large(size, self.limit, self.link.max_payload)
        if peer.out_bytes + size > self.limit:
            self._flush(peer)
        peer.out.append(frame)
        peer.out_bytes += size
        self._flush_at_turn_end(peer)

    def next_batch(self, peer: _Peer) -> int:
        """The number of the batch the frames sent now go in."""
        return peer.sent + 1

    def heartbeat(self, peer: _Peer, ping: bool) -> None:
        """A batch to `peer` now, with what is queued for it (if nothing, an empty one)."""
        frames, peer.out, peer.out_bytes = peer.out, [], 0
        self._publish(peer, frames, ping)

    def _flush_at_turn_end(self, peer: _Peer) -> None:
        if peer not in self._flush_soon:
            if not self._flush_soon:
                asyncio.get_running_loop().call_soon(self._flush_all)
            self._flush_soon.add(peer)

    def _flush_all(self) -> None:
        peers, self._flush_soon = self._flush_soon, set()
        for peer in peers:
            self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        frames, peer.out, peer.out_bytes = peer.out, [], 0
        if frames or peer.reset_below:
            self._publish(peer, frames)

    def _publish(self, peer: _Peer, frames: list[Frame], ping: bool = False) -> None:
        peer.sent += 1
        batch = Batch(sender=self.prefix, seq=peer.sent, frames=frames, reset_below=peer.reset_below, ping=ping,
                      sent_at=time.time())
        peer.reset_below = 0
        subject = f"{peer.prefix}.{INBOX}"
        data = self.auth.sign_batch(subject.encode(), codec.encode(batch))
        self.link.publish(subject, data, f"{self.prefix}.{GONE}.{peer.index}")

    # -- receiving ------------------------------------------------------------------
    async def _received(self, msg: Msg) -> None:
        subject = msg.subject
        if subject == self.inbox:
            self._batch(msg.data, msg.reply)
        elif subject.startswith(f"{self.prefix}.{GONE}.") and msg.headers:
            index = subject.rpartition(".")[2]
            peer = self._by_index.get(int(index)) if index.isdigit() else None
            if peer is None:
                return
            if msg.headers.get("Status") == "503":  # the NATS server's "no responders"
                self._on_gone(peer, "no subscriber on its subject (its process ended or left NATS)",
                              no_subscriber=True)
            elif refusal := msg.headers.get(REFUSED_HEADER):  # the peer dropped our batch unread
                self._on_gone(peer, f"it refused this process's messages: {refusal[:200]}", no_subscriber=True)

    def _refuse(self, reply: str, why: str) -> None:
        """Tell the sender of a batch we dropped unread why, on its reply subject (unsigned: it may not share
        our key), so that it fails its streams at once instead of after its silence timeout."""
        if _GONE_SUBJECT.match(reply or ""):
            self.link.publish(reply, b"", "", headers={REFUSED_HEADER: why})

    def _batch(self, data: bytes, reply: str) -> None:
        payload = self.auth.verified_batch(self._inbox_bytes, data)
        if payload is None:
            _warn("request plane: dropped a NATS message on %s with a wrong or missing cluster-key signature",
                  self.inbox)
            self._refuse(reply, "a wrong or missing cluster-key signature (give every process the same "
                                "--cluster-key)")
            return
        try:
            batch = codec.decode(payload, Batch)
        except DecodeError as exc:
            _warn("request plane: dropped an undecodable NATS message on %s: %s", self.inbox, exc)
            self._refuse(reply, "undecodable (signed with a --cluster-key this process does not have?)")
            return
        if not _PREFIX.match(batch.sender):
            _warn("request plane: dropped a NATS message on %s from an invalid sender %r", self.inbox,
                  batch.sender[:80])
            return
        if self.auth.enabled and abs(time.time() - batch.sent_at) > MAX_BATCH_AGE_S:
            _warn("request plane: dropped a NATS message on %s sent %.0f s ago (a replay, or clocks apart)",
                  self.inbox, time.time() - batch.sent_at)
            return
        peer = self.peer(batch.sender)
        if batch.seq < peer.expected:
            _warn("request plane: dropped a NATS message on %s from %s numbered %d (expected %d): a duplicate "
                  "or a replay", self.inbox, batch.sender, batch.seq, peer.expected)
            return
        peer.heard = time.monotonic()
        if batch.seq > peer.expected:
            logger.warning("request plane: %d message(s) from %s to %s were lost; their streams end",
                           batch.seq - peer.expected, batch.sender, self.prefix)
            peer.reset_below = batch.seq
            self._flush_at_turn_end(peer)  # tell it now, even with nothing else to send
            self._on_lost(peer, batch.seq)
        peer.expected = batch.seq + 1
        if batch.reset_below:
            self._on_reset(peer, batch.reset_below)
        self._on_batch(peer, batch)
        if batch.ping and not self._has_streams(peer):
            self.heartbeat(peer, ping=False)

    # -- liveness -------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                if not self._has_streams(peer):
                    if self.forgets_idle_peers and now - peer.heard > 5 * MAX_BATCH_AGE_S:
                        self.forget(peer)  # its numbering is kept this long against replays
                    continue
                if now - peer.heard > PEER_TIMEOUT_S:
                    self._on_gone(peer, f"nothing from it in {PEER_TIMEOUT_S:g}s (hung, cut off from NATS, or "
                                        f"it has another --cluster-key)", no_subscriber=False)
                else:
                    self.heartbeat(peer, ping=True)

    # -- the owner's --------------------------------------------------------------
    def _has_streams(self, peer: _Peer) -> bool:
        raise NotImplementedError

    def _on_batch(self, peer: _Peer, batch: Batch) -> None:
        raise NotImplementedError

    def _on_lost(self, peer: _Peer, below: int) -> None:
        raise NotImplementedError

    def _on_reset(self, peer: _Peer, below: int) -> None:
        raise NotImplementedError

    def _on_gone(self, peer: _Peer, why: str, no_subscriber: bool) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------- server


class _ClientPeer:
    """A server's view of one client: the connection interface RequestPlaneServer's stream tasks use
    (send, blocked, stream_done, fail_streams, close)."""

    def __init__(self, mailbox: _ServerMailbox, peer: _Peer):
        self._mailbox = mailbox
        self._peer = peer
        self.streams: dict[int, tuple[asyncio.Task[None], StreamContext]] = {}

    @property
    def blocked(self) -> asyncio.Future[None] | None:
        return self._mailbox.link.blocked

    def send(self, frame: Frame) -> None:
        self._mailbox.send(self._peer, frame)

    def stream_done(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def fail_streams(self, error: WorkerError, endpoints: Container[str] | None = None) -> list[asyncio.Task]:
        failed = []
        for stream_id, (task, ctx) in list(self.streams.items()):
            if endpoints is None or ctx.endpoint in endpoints:
                del self.streams[stream_id]
                _send_error(self, stream_id, error)
                ctx.cancelled = True
                task.cancel()
                failed.append(task)
        return failed

    def cancel_all(self) -> None:
        for task, ctx in self.streams.values():
            ctx.cancelled = True
            task.cancel()
        self.streams.clear()

    def close(self) -> None:
        self._mailbox._flush(self._peer)


class _ServerMailbox(Mailbox):
    forgets_idle_peers = True

    def __init__(self, server: NatsRequestPlaneServer, link: NatsLink):
        super().__init__(link, server.auth, server.max_frame_bytes)
        self.server = server

    def client_of(self, peer: _Peer) -> _ClientPeer:
        if peer.state is None:
            peer.state = _ClientPeer(self, peer)
            self.server._connections.add(peer.state)
        return peer.state

    def _has_streams(self, peer: _Peer) -> bool:
        return peer.state is not None and bool(peer.state.streams)

    def _on_batch(self, peer: _Peer, batch: Batch) -> None:
        if self.server._accepting is False:
            return  # stopping: the client learns it from the missing subscription
        conn = self.client_of(peer)
        for frame in batch.frames:
            if frame.kind == REQUEST:
                if frame.stream_id in conn.streams:
                    _warn("request plane: %s opened stream %d twice; ignored", peer.prefix, frame.stream_id)
                    continue
                ctx = StreamContext(frame.stream_id, frame.endpoint, frame.traceparent, frame.tracestate)
                conn.streams[frame.stream_id] = (self.server._spawn(conn, ctx, frame.payload), ctx)
            elif frame.kind == CANCEL:
                entry = conn.streams.pop(frame.stream_id, None)
                if entry is not None:
                    entry[1].cancelled = True
                    entry[0].cancel()

    def _on_lost(self, peer: _Peer, below: int) -> None:
        if peer.state is not None:  # every stream it had open came in a batch before the gap
            peer.state.cancel_all()

    def _on_reset(self, peer: _Peer, below: int) -> None:
        # The client lost some of our batches and failed every stream it had here: so do we.
        if peer.state is not None:
            peer.state.cancel_all()

    def _on_gone(self, peer: _Peer, why: str, no_subscriber: bool) -> None:
        if peer.state is not None and peer.state.streams:
            logger.warning("request plane: client %s is gone (%s): cancelling its %d stream(s)", peer.prefix, why,
                           len(peer.state.streams))
            peer.state.cancel_all()
        if peer.state is not None:
            self.server._connections.discard(peer.state)
        self.forget(peer)


class NatsRequestPlaneServer(RequestPlaneServer):
    """RequestPlaneServer on NATS: the same endpoints, handlers, drain, refusals and stop; its
    `address` is "nats://host:port/<prefix>" once started."""

    def __init__(self, nats_server: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 auth: ClusterAuth | None = None) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes, auth=auth)
        self.nats_server = nats_server
        self._mailbox: _ServerMailbox | None = None
        self._accepting: bool | None = None

    async def start(self) -> None:
        link = await NatsLink.acquire(self.nats_server)
        self._mailbox = _ServerMailbox(self, link)
        await self._mailbox.open()
        self._accepting = True

    @property
    def address(self) -> str:
        if self._mailbox is None:
            raise RuntimeError("server not started")
        return f"{self._mailbox.link.server}/{self._mailbox.prefix}"

    async def stop(self, error: WorkerError | None = None) -> None:
        mailbox, self._mailbox = self._mailbox, None
        self._accepting = False
        if mailbox is not None:
            await mailbox.close()  # new requests now get "no responders": the client tries another worker
        if error is not None:
            for conn in list(self._connections):
                conn.fail_streams(error)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if mailbox is not None:
            mailbox._flush_all()  # the last frames (errors) leave before the link may close
            self._connections.clear()
            await mailbox.link.release()


# ---------------------------------------------------------------- client


class _ServerPeer:
    """A client's view of one server: the connection interface ResponseStream uses (closed, failure,
    open_stream, cancel_stream)."""

    def __init__(self, mailbox: _ClientMailbox, peer: _Peer, address: str):
        self._mailbox = mailbox
        self._peer = peer
        self.address = address
        self.closed = False
        self.failure = ""
        # stream id -> (stream, the batch its request went in, whether the server answered it yet)
        self.streams: dict[int, list] = {}
        self._next_id = 1

    def open_stream(self, stream: ResponseStream[Any], endpoint: str, payload: bytes, trace=None) -> int:
        stream_id = self._next_id
        frame = Frame(kind=REQUEST, stream_id=stream_id, endpoint=endpoint, payload=payload)
        if trace is not None:
            frame.traceparent, frame.tracestate = trace
        if not self.streams:
            self._peer.heard = time.monotonic()  # silence counts from now
        self._mailbox.send(self._peer, frame)  # FrameTooLarge before anything is recorded
        self._next_id += 1
        self.streams[stream_id] = [stream, self._mailbox.next_batch(self._peer), False]
        return stream_id

    def cancel_stream(self, stream_id: int) -> None:
        if self.streams.pop(stream_id, None) is not None and not self.closed:
            self._mailbox.send(self._peer, Frame(kind=CANCEL, stream_id=stream_id))

    def receive(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == CHUNK:
            entry = self.streams.get(frame.stream_id)
        elif kind == END or kind == ERROR:
            entry = self.streams.pop(frame.stream_id, None)
        else:
            return  # a kind from a newer peer
        if entry is not None:  # None: a stream we cancelled already; late frames are expected
            entry[2] = True
            entry[0]._push(frame)

    def fail(self, why: str, below: int | None = None, tell: bool = False, unanswered: RequestPlaneError | None = None
             ) -> None:
        """End the streams (opened in a batch numbered below `below`, None: all) with PeerDisconnected
        (those the server never answered: `unanswered`, if given); `tell`: send the server their cancels."""
        for stream_id, (stream, opened_in, answered) in list(self.streams.items()):
            if below is not None and opened_in >= below:
                continue
            del self.streams[stream_id]
            if tell:
                self._mailbox.send(self._peer, Frame(kind=CANCEL, stream_id=stream_id))
            if not answered and unanswered is not None:
                stream._fail(unanswered)
            else:
                stream._fail(PeerDisconnected(f"request plane: {self.address}: {why}"))


class _ClientMailbox(Mailbox):
    def _has_streams(self, peer: _Peer) -> bool:
        return peer.state is not None and bool(peer.state.streams)

    def _on_batch(self, peer: _Peer, batch: Batch) -> None:
        server = peer.state
        if server is None:
            return  # a server we never called
        for frame in batch.frames:
            server.receive(frame)

    def _on_lost(self, peer: _Peer, below: int) -> None:
        if peer.state is not None:  # we cannot know whose frames were lost: every stream there ends
            peer.state.fail("frames from it were lost on the way (NATS reconnect or slow consumer)", tell=True)

    def _on_reset(self, peer: _Peer, below: int) -> None:
        if peer.state is not None:
            peer.state.fail("it lost frames from this process (NATS reconnect or slow consumer)", below=below)

    def _on_gone(self, peer: _Peer, why: str, no_subscriber: bool) -> None:
        if peer.state is not None:
            # Nobody subscribed: a request it never answered was never received (another worker may take
            # it as if it had not been sent); silent: it may be running there.
            unanswered = ConnectFailed(f"{peer.state.address}: {why}") if no_subscriber else None
            peer.state.fail(why, unanswered=unanswered)


class NatsRequestPlaneClient(RequestPlaneClient):
    """RequestPlaneClient on NATS: streams to servers' "nats://…/<prefix>" addresses, through the NATS
    server `nats_server` (connected at the first stream)."""

    def __init__(self, nats_server: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = 3.0,
                 auth: ClusterAuth | None = None) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes, connect_timeout=connect_timeout, auth=auth)
        self.nats_server = nats_server
        self._mailbox: _ClientMailbox | None = None
        self._opening: asyncio.Task[_ClientMailbox] | None = None

    async def close(self) -> None:
        mailbox, self._mailbox = self._mailbox, None
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        self._opening = None
        if mailbox is None:
            return
        for peer in list(mailbox.peers.values()):
            if peer.state is not None:
                peer.state.fail("this client closed", tell=True)
                peer.state.closed = True
        await mailbox.close()
        await mailbox.link.release()

    async def _connection(self, address: str) -> _ServerPeer:
        if not is_nats_address(address):
            raise ConnectFailed(f"{address!r} is not on the NATS request plane (this process uses --request-plane "
                                f"nats)")
        prefix = prefix_of(address)
        mailbox = self._mailbox
        if mailbox is None:
            if self._opening is None:
                self._opening = asyncio.get_running_loop().create_task(self._open())
            try:
                mailbox = await asyncio.shield(self._opening)
            except ConnectFailed:
                self._opening = None
                raise
        peer = mailbox.peer(prefix)
        if peer.state is None:
            peer.state = _ServerPeer(mailbox, peer, address)
        return peer.state

    async def _open(self) -> _ClientMailbox:
        try:
            async with asyncio.timeout(self.connect_timeout + 5):
                link = await NatsLink.acquire(self.nats_server)
        except (EventPlaneError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot reach the NATS server of the request plane: {exc}") from None
        mailbox = _ClientMailbox(link, self.auth, self.max_frame_bytes)
        await mailbox.open()
        self._mailbox = mailbox
        return mailbox

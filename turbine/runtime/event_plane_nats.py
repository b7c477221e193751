"""The nats event-plane backend: publishers send to a NATS server, on subjects named after their
instance ("turbine.events.<instance_id>.<topic>"), and announce "nats://host:port/turbine.events.
<instance_id>" in their model card; subscribers subscribe to the topics they want there.

nats-py publishes asynchronously; the engine path must never wait, so `publish()` only queues
the message and one task per connection sends the queue in order. One connection per process
(the mocker's N workers share it), reconnecting by itself; what is lost meanwhile shows up as
an event-id gap, which routers recover. A subscriber whose connection came back says so in
its queue (RESUBSCRIBED), so that routers recover what was lost at once, not at the
publisher's next event (an idle worker may send none for long).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from turbine.runtime import cluster_auth
from turbine.runtime.cluster_auth import ClusterAuth
from turbine.runtime.codec import encode
from turbine.runtime.errors import EventPlaneError

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger("turbine.event_plane")

SUBJECT_ROOT = "turbine.events"
CONNECT_TIMEOUT_S = 5.0
MAX_QUEUED = 100_000  # messages waiting to be sent; beyond that they are dropped (gaps recover them)
RETRY_S = (0.5, 10.0)  # a subscriber's reconnect backoff, first and longest
WARN_EVERY_S = 10.0
# Not a topic on the wire: EventSubscriber.recv() returns (RESUBSCRIBED, address) when the
# connection to `address` came back after a break (the server restarted or was unreachable).
RESUBSCRIBED = b"\x00resubscribed"


def parse_server(url: str) -> str:
    """Check a --nats-server value ("nats://host:port"); returns it without credentials or path."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme != "nats" or not parts.hostname or port == -1:
        raise ValueError(f"{url!r}: expected nats://HOST[:PORT]")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"nats://{host}:{port or 4222}"


def parse_address(address: str) -> tuple[str, str]:
    """A card's "nats://host:port/<subject prefix>" -> (server URL, subject prefix)."""
    prefix = urlsplit(address).path.strip("/")
    if not prefix:
        raise ValueError(f"NATS event-plane address {address!r} names no subject")
    return parse_server(address), prefix


async def connect_nats(server: str, what: str, reconnected: Callable[[], None] | None = None) -> Client:
    """Connected, or EventPlaneError after CONNECT_TIMEOUT_S; reconnects forever afterwards,
    then calls `reconnected` (the server has our subscriptions again by then)."""
    # nats-py (and the aiohttp it imports) here, not at the top: most processes never use NATS, and the import
    # is ~0.15 s of CPU each (the test suite starts some 300 frontends, mockers and routers).
    from nats.aio.client import Client
    from nats.errors import Error as NatsError

    last_error: list[BaseException] = []
    warned = [0.0]

    async def on_error(exc: BaseException) -> None:
        last_error[:] = [exc]
        if time.monotonic() - warned[0] > WARN_EVERY_S and client.is_connected:
            warned[0] = time.monotonic()
            log.warning("NATS %s (%s): %s", server, what, exc)

    async def on_disconnected() -> None:
        if client.is_closed or client.is_draining:
            return  # we are closing it
        log.warning("NATS %s (%s): disconnected; reconnecting", server, what)

    async def on_reconnected() -> None:
        log.info("NATS %s (%s): reconnected", server, what)
        if reconnected is not None:
            reconnected()

    client = Client()
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await client.connect(server, error_cb=on_error, disconnected_cb=on_disconnected,
                                 reconnected_cb=on_reconnected, max_reconnect_attempts=-1,
                                 reconnect_time_wait=0.5, connect_timeout=2)
    except (TimeoutError, OSError, NatsError) as exc:
        await client.close()
        reason = last_error[0] if last_error else exc
        raise EventPlaneError(f"cannot reach the NATS server {server}: {type(reason).__name__}: {reason}") from None
    return client


class NatsConnection:
    """A worker process's publishing connection, with its send queue."""

    def __init__(self, client: Client, server: str):
        self.server = server
        self._client = client
        self._queue: deque[tuple[str, bytes]] = deque()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._sender = self._loop.create_task(self._send_queued())
        self.dropped = 0

    @classmethod
    async def open(cls, server: str) -> NatsConnection:
        try:
            server = parse_server(server)
            client = await connect_nats(server, "publishing events")
        except (ValueError, EventPlaneError) as exc:
            raise EventPlaneError(f"--nats-server: {exc}") from None
        log.info("event plane: NATS at %s", server)
        return cls(client, server)

    def send(self, subject: str, data: bytes) -> None:
        """Queue one message (never waits). Safe from any thread."""
        if len(self._queue) >= MAX_QUEUED:
            self._drop(f"{MAX_QUEUED} messages queued")
            return
        self._queue.append((subject, data))
        if threading.get_ident() == self._thread:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _send_queued(self) -> None:
        queue = self._queue
        while True:
            await self._wake.wait()
            self._wake.clear()
            while queue:
                subject, data = queue.popleft()
                try:
                    await self._client.publish(subject, data)
                except Exception as exc:  # disconnected with a full buffer, closed...: dropped
                    self._drop(f"{type(exc).__name__}: {exc}")

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 10_000 == 0:
            log.warning("NATS %s: %d event-plane message(s) dropped so far (%s); routers recover by event id",
                        self.server, self.dropped, why)

    async def close(self) -> None:
        """Send what is queued, then close."""
        if self._queue and self._client.is_connected:
            self._wake.set()
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not self._queue:
                    break
        self._sender.cancel()
        try:
            await asyncio.wait_for(self._client.drain(), 2)
        except Exception:  # closing anyway
            pass
        await self._client.close()


class NatsEventPublisher:
    """One instance's publisher: publish(topic, message) and .address, as the zmq one."""

    def __init__(self, conn: NatsConnection, instance_id: str, auth: ClusterAuth | None = None):
        self._conn = conn
        self._auth = auth if auth is not None else cluster_auth.current()
        self.subject_prefix = f"{SUBJECT_ROOT}.{instance_id}"
        self.address = f"{conn.server}/{self.subject_prefix}"
        self._subjects: dict[bytes, str] = {}

    def publish(self, topic: bytes, message: msgspec.Struct) -> None:
        self.publish_bytes(topic, encode(message))

    def publish_bytes(self, topic: bytes, data: bytes) -> None:
        subject = self._subjects.get(topic)
        if subject is None:
            subject = self._subjects[topic] = f"{self.subject_prefix}.{topic.decode()}"
        self._conn.send(subject, self._auth.sign(topic, data))  # checked by EventSubscriber.recv

    def close(self) -> None:
        pass  # the connection is the process's (WorkerEventPlane.close)


class NatsEventSubscriber:
    """Subscribes to the topics of each followed publisher; messages go to `queue` as
    (topic, payload). One connection per NATS server, retried loudly until it is reached."""

    def __init__(self, topics: tuple[bytes, ...], queue: asyncio.Queue):
        self.topics = topics
        self._queue = queue
        self._clients: dict[str, asyncio.Task[Client]] = {}  # server -> connecting/connected
        self._subscribing: dict[str, asyncio.Task] = {}  # address -> task that holds its subscriptions
        self._ready: dict[str, asyncio.Future] = {}  # address -> done once the server has its subscriptions
        self.dropped = 0

    def connect(self, address: str) -> None:
        server, prefix = parse_address(address)
        if server not in self._clients:
            self._clients[server] = asyncio.get_running_loop().create_task(self._connect_retrying(server))
        loop = asyncio.get_running_loop()
        self._ready[address] = loop.create_future()
        self._subscribing[address] = loop.create_task(self._follow(server, prefix, self._ready[address]))

    def disconnect(self, address: str) -> None:
        task = self._subscribing.pop(address, None)
        if task is not None:
            task.cancel()  # its `finally` unsubscribes
        ready = self._ready.pop(address, None)
        if ready is not None:
            ready.cancel()

    def subscribed(self, address: str) -> asyncio.Future:
        """Done once messages published to `address` from now on are delivered."""
        return self._ready[address]

    async def _connect_retrying(self, server: str) -> Client:
        delay = RETRY_S[0]
        while True:
            try:
                return await connect_nats(server, "following events", lambda: self._resubscribed(server))
            except EventPlaneError as exc:
                log.warning("%s (KV events of its workers are not followed); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_S[1])

    def _resubscribed(self, server: str) -> None:
        for address in self._subscribing:
            if parse_address(address)[0] == server:
                try:
                    self._queue.put_nowait((RESUBSCRIBED, address.encode()))
                except asyncio.QueueFull:  # the consumer is behind: the next event's id gap still tells
                    self.dropped += 1

    async def _follow(self, server: str, prefix: str, ready: asyncio.Future) -> None:
        client = await asyncio.shield(self._clients[server])
        subs = []
        try:
            for topic in self.topics:
                subs.append(await client.subscribe(f"{prefix}.{topic.decode()}", cb=self._on_message))
            # The server has them once a PONG follows them. nats-py (2.16) writes flush()'s PING
            # straight to the socket, ahead of a SUB still queued for its flusher task, so the
            # first PONG can come before the server has seen the SUBs; by the second flush the
            # flusher has written them (seen as a lost first event under load).
            await client.flush()
            await client.flush()
            if not ready.done():
                ready.set_result(None)
            await asyncio.Event().wait()  # until disconnect() cancels us
        finally:
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is closing anyway
                    pass

    async def _on_message(self, msg) -> None:
        topic = msg.subject.rpartition(".")[2].encode()
        try:
            self._queue.put_nowait((topic, msg.data))
        except asyncio.QueueFull:  # the consumer is behind: dropped, and the event id gap says so
            self.dropped += 1

    def close(self) -> None:
        for address in list(self._subscribing):
            self.disconnect(address)
        for task in self._clients.values():
            if task.done() and not task.cancelled() and task.exception() is None:
                asyncio.get_running_loop().create_task(task.result().close())
            else:
                task.cancel()
        self._clients.clear()

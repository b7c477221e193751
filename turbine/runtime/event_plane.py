"""Event plane: KV events and load metrics from workers to routers. Two backends:

- zmq (default): each publisher binds a PUB socket and announces its address ("tcp://host:port")
  in its model card; subscribers connect to the publishers they care about.
- nats (turbine/runtime/event_plane_nats.py): publishers send to a NATS server on subjects of
  their own, announced as "nats://server:port/<subject prefix>"; subscribers subscribe there.

A subscriber picks the backend from each address's scheme, so routers need no flag. Messages
are a topic and a msgpack-encoded typed struct. Either backend may drop messages (a slow
subscriber, a reconnect): that is why events carry ids (gaps are detected and recovered).

A subscriber also says when its connection to a publisher came back (RESUBSCRIBED), so that
what was lost is recovered without waiting for the publisher's next event.

With a cluster key (turbine/runtime/cluster_auth.py) every message carries a MAC (keyed BLAKE2b)
of its topic and payload; a subscriber drops (and logs) a message whose signature is wrong before
anything decodes it. Signing rather than ZMQ CURVE: one mechanism for both backends, and with NATS the
server relays whatever anyone allowed on it publishes, so only a per-message proof says who
wrote it.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from turbine.runtime import cluster_auth
from turbine.runtime.cluster_auth import ClusterAuth, RateLimitedWarning
from turbine.runtime.codec import encode
from turbine.runtime.errors import EventPlaneError
from turbine.runtime.event_plane_nats import RESUBSCRIBED, NatsConnection, NatsEventPublisher, NatsEventSubscriber
from turbine.runtime.registration import advertised_address

log = logging.getLogger("turbine.event_plane")

KV_EVENTS_TOPIC = b"kv-events"
LOAD_METRICS_TOPIC = b"load-metrics"
SEND_HWM = 100_000  # queued messages per subscriber before PUB drops
ZMQ_SUBSCRIBE_SETTLE_S = 0.01  # after the handshake: measured enough here (1 ms already was)
EVENT_PLANES = ("zmq", "nats")
DEFAULT_NATS_SERVER = "nats://127.0.0.1:4222"


class EventPublisher:
    """zmq: one PUB socket per publishing instance (one address in its model card), shared by
    every topic it publishes."""

    def __init__(self, host: str = "127.0.0.1", context: zmq.Context | None = None, auth: ClusterAuth | None = None):
        self._auth = auth if auth is not None else cluster_auth.current()
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = "tcp://" + advertised_address(f"{host}:{port}")

    def publish(self, topic: bytes, message: msgspec.Struct) -> None:
        self.publish_bytes(topic, encode(message))

    def publish_bytes(self, topic: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([topic, self._auth.sign(topic, data)], flags=zmq.NOBLOCK)
        except zmq.Again:  # no room: dropped, and the event id gap tells subscribers
            pass

    def close(self) -> None:
        self._sock.close()


class ZmqEventSubscriber:
    def __init__(self, topics: tuple[bytes, ...]):
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        for topic in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        # The handshake with a publisher carries our subscriptions right behind it: once it is
        # done, what the publisher sends next reaches us (see `subscribed`).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._connected: dict[str, asyncio.Future] = {}
        self._watch = asyncio.get_running_loop().create_task(self._watch_handshakes())

    def connect(self, address: str) -> None:
        self._connected[address] = asyncio.get_running_loop().create_future()
        self._sock.connect(address)

    def disconnect(self, address: str) -> None:
        future = self._connected.pop(address, None)
        if future is not None:
            future.cancel()
        try:
            self._sock.disconnect(address)
        except zmq.ZMQError:
            pass

    def subscribed(self, address: str) -> asyncio.Future:
        return self._connected[address]

    async def _watch_handshakes(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            future = self._connected.get(event["endpoint"].decode())
            if future is not None and not future.done():
                future.set_result(None)

    async def recv(self) -> tuple[bytes, bytes]:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) == 2:
                return parts[0], parts[1]
            # Not (topic, payload): unpacking it raised and ended the receive loop (found by fuzzing).
            log.warning("event-plane message of %d part(s) dropped (expected topic and payload)", len(parts))

    def close(self) -> None:
        self._watch.cancel()
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()


def is_nats_address(address: str) -> bool:
    return address.startswith("nats://")


class EventSubscriber:
    """Follows publishers on either backend, each picked by its address's scheme."""

    def __init__(self, topics: tuple[bytes, ...] = (KV_EVENTS_TOPIC,), auth: ClusterAuth | None = None):
        self.topics = topics
        self.auth = auth if auth is not None else cluster_auth.current()
        self.forged = 0  # messages dropped for a wrong signature
        self._warn_forged = RateLimitedWarning(log)
        self.addresses: set[str] = set()
        self._queue: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(maxsize=SEND_HWM)
        self._zmq: ZmqEventSubscriber | None = None
        self._zmq_pump: asyncio.Task | None = None
        self._nats = None  # NatsEventSubscriber, made on the first nats:// address

    def connect(self, address: str) -> None:
        if address in self.addresses:
            return
        if is_nats_address(address):
            if self._nats is None:
                self._nats = NatsEventSubscriber(self.topics, self._queue)
            self._nats.connect(address)
        elif address.startswith(("tcp://", "ipc://")):
            if self._zmq is None:
                self._zmq = ZmqEventSubscriber(self.topics)
                self._zmq_pump = asyncio.get_running_loop().create_task(self._pump(self._zmq))
            self._zmq.connect(address)
        else:
            raise ValueError(f"event-plane address {address!r}: expected tcp:// (zmq) or nats://")
        self.addresses.add(address)

    def disconnect(self, address: str) -> None:
        if address not in self.addresses:
            return
        self.addresses.discard(address)
        if is_nats_address(address):
            self._nats.disconnect(address)
        else:
            self._zmq.disconnect(address)

    async def subscribed(self, address: str) -> None:
        """Returns once what `address` publishes from now on is delivered (nats: the server has
        our subscriptions; zmq: the handshake, which our subscriptions follow on the wire, is
        done). Whatever slips through anyway shows up as an event-id gap."""
        if address not in self.addresses:
            return
        if is_nats_address(address):
            await asyncio.shield(self._nats.subscribed(address))
        else:
            await asyncio.shield(self._zmq.subscribed(address))
            await asyncio.sleep(ZMQ_SUBSCRIBE_SETTLE_S)  # for the publisher's I/O thread to take them

    async def recv(self) -> tuple[bytes, bytes]:
        """The next (topic, payload) from any publisher followed whose signature is right, or
        (RESUBSCRIBED, address): messages `address` published before may have been lost."""
        while True:
            topic, signed = await self._queue.get()
            if topic == RESUBSCRIBED:  # put there by our own NATS subscriber: never read off the wire
                return topic, signed
            payload = self.auth.verified(topic, signed)
            if payload is not None:
                return topic, payload
            self.forged += 1
            self._warn_forged("event plane: dropped a %r message without a valid cluster-key signature (forged, or "
                              "published with another key); not decoded", topic)

    async def _pump(self, sub: ZmqEventSubscriber) -> None:
        while True:
            await self._queue.put(await sub.recv())  # a full queue pushes back on zmq, which drops

    def close(self) -> None:
        if self._zmq_pump is not None:
            self._zmq_pump.cancel()
        if self._zmq is not None:
            self._zmq.close()
        if self._nats is not None:
            self._nats.close()


class WorkerEventPlane:
    """A worker process's way onto the event plane: `publisher(instance_id)` for each instance
    it serves. With nats, all of them share the process's one connection."""

    def __init__(self, backend: str, host: str, nats=None, auth: ClusterAuth | None = None):
        self.backend = backend
        self.host = host
        self._nats = nats  # NatsConnection
        self.auth = auth if auth is not None else cluster_auth.current()

    @classmethod
    async def open(cls, backend: str, host: str = "127.0.0.1", nats_server: str = DEFAULT_NATS_SERVER,
                   auth: ClusterAuth | None = None) -> WorkerEventPlane:
        """Raises EventPlaneError naming --nats-server if the NATS server cannot be reached."""
        if backend == "zmq":
            return cls("zmq", host, auth=auth)
        if backend == "nats":
            return cls("nats", host, await NatsConnection.open(nats_server), auth=auth)
        raise EventPlaneError(f"--event-plane {backend!r}: choose from {', '.join(EVENT_PLANES)}")

    def publisher(self, instance_id: str):
        """An EventPublisher (zmq) or NatsEventPublisher: publish(topic, message), .address."""
        if self._nats is None:
            return EventPublisher(self.host, auth=self.auth)
        return NatsEventPublisher(self._nats, instance_id, auth=self.auth)

    async def close(self) -> None:
        """Sends what is still queued (nats) and closes the connection."""
        if self._nats is not None:
            await self._nats.close()

"""Event plane (zmq backend): each publisher binds a PUB socket and announces its address
(in its model card); subscribers connect to the publishers they care about.

Messages are two frames, a topic and a msgpack-encoded typed struct. PUB/SUB drops
messages when a subscriber falls behind; that is why events carry ids (gaps are detected).
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from turbine.runtime.codec import encode
from turbine.runtime.registration import advertised_address

log = logging.getLogger("turbine.event_plane")

KV_EVENTS_TOPIC = b"kv-events"
LOAD_METRICS_TOPIC = b"load-metrics"
SEND_HWM = 100_000  # queued messages per subscriber before PUB drops


class EventPublisher:
    """One per worker process side (one address in its model card), shared by every topic it publishes."""

    def __init__(self, host: str = "127.0.0.1", context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = "tcp://" + advertised_address(f"{host}:{port}")

    def publish(self, topic: bytes, message: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([topic, encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:  # no room: dropped, and the event id gap tells subscribers
            pass

    def close(self) -> None:
        self._sock.close()


class EventSubscriber:
    def __init__(self, topics: tuple[bytes, ...] = (KV_EVENTS_TOPIC,)):
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        for topic in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.addresses: set[str] = set()

    def connect(self, address: str) -> None:
        if address not in self.addresses:
            self._sock.connect(address)
            self.addresses.add(address)

    def disconnect(self, address: str) -> None:
        if address in self.addresses:
            self.addresses.discard(address)
            try:
                self._sock.disconnect(address)
            except zmq.ZMQError:
                pass

    async def recv(self) -> tuple[bytes, bytes]:
        """The next (topic, payload)."""
        topic, payload = await self._sock.recv_multipart()
        return topic, payload

    def close(self) -> None:
        self._sock.close()

"""A router's one subscription to its workers' event plane.

Each worker publishes several topics (KV events, load metrics) at the one address in its model
card. A router follows them all through one subscriber: one connection per worker whatever the
number of topics, one receive loop, and each message handed to the handler of its topic (the
KV events consumer, the load-metrics consumer). Handlers say which workers they follow;
a worker's connection stays while any handler follows it. When a connection comes back after a
break (a NATS restart), the consumers that asked are told, to recover what they missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

from turbine.runtime.event_plane import EventSubscriber
from turbine.runtime.event_plane_nats import RESUBSCRIBED

log = logging.getLogger("turbine.router")

Handler = Callable[[bytes], None]  # one message's payload, still encoded


class RouterEventSubscriber:
    def __init__(self):
        self._handlers: dict[bytes, Handler] = {}
        self._on_resubscribed: list[Callable[[str], None]] = []
        self._sub: EventSubscriber | None = None  # made on the first follow: its topics are fixed then
        self._followers: dict[str, int] = {}  # address -> how many follow() calls hold it
        self._task: asyncio.Task | None = None

    def on(self, topic: bytes, handler: Handler) -> None:
        """Hand `topic`'s messages to `handler` (before the first follow: subscriptions are made then)."""
        if self._sub is not None and topic not in self._sub.topics:
            raise RuntimeError(f"topic {topic!r} added after the subscription was made")
        self._handlers[topic] = handler

    def on_resubscribed(self, callback: Callable[[str], None]) -> None:
        """Call `callback(address)` when the connection to `address` came back: what it
        published meanwhile may be lost."""
        self._on_resubscribed.append(callback)

    def follow(self, address: str) -> None:
        """Receive what the publisher at `address` sends (once per follow, however many: each
        follow is matched by an unfollow). ValueError for an address of no known backend."""
        n = self._followers.get(address, 0)
        if n == 0:
            if self._sub is None:
                self._sub = EventSubscriber(topics=tuple(self._handlers))
                self._task = asyncio.get_running_loop().create_task(self._run())
            self._sub.connect(address)
        self._followers[address] = n + 1

    def unfollow(self, address: str) -> None:
        n = self._followers.pop(address, 0)
        if n > 1:
            self._followers[address] = n - 1
        elif n == 1:
            self._sub.disconnect(address)

    def release(self, addresses, owner: bool) -> None:
        """A consumer is done with `addresses`: close us if it owns us, else unfollow them."""
        if owner:
            self.close()
        else:
            for address in addresses:
                self.unfollow(address)

    def subscribed(self, address: str) -> Coroutine[None, None, None]:
        """Completes once what `address` publishes from now on is delivered (see EventSubscriber)."""
        if self._sub is None:
            return asyncio.sleep(0)
        return self._sub.subscribed(address)

    async def _run(self) -> None:
        while True:
            topic, payload = await self._sub.recv()
            if topic == RESUBSCRIBED:
                address = payload.decode()
                if address in self._followers:
                    for callback in self._on_resubscribed:
                        try:
                            callback(address)
                        except Exception:
                            log.exception("resubscription to %s could not be handled", address)
                continue
            handler = self._handlers.get(topic)
            if handler is None:
                continue
            try:
                handler(payload)
            except Exception:  # a handler's bug must not stop the other topics
                log.exception("event-plane message on topic %r could not be handled", topic)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            self._sub.close()
        self._followers.clear()

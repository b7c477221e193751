"""A worker's side of load metrics: its engine's numbers, published on change, coalesced.

The engine reports after every step (often thousands of times a second on a simulated fleet).
Per data-parallel rank, at most one message goes out per `min_interval_s`: a change that
comes sooner is held and the latest state is sent when the interval ends. Publishing never
blocks (the event plane drops rather than waits). A state is also re-sent every
`keepalive_s` when nothing changed, so that a router that starts later learns it.
"""

from __future__ import annotations

import asyncio
import time

from turbine.protocol.load_metrics import LoadMetrics
from turbine.runtime.event_plane import LOAD_METRICS_TOPIC

MIN_INTERVAL_S = 0.05
KEEPALIVE_S = 5.0

# kv_active_blocks, kv_total_blocks, num_running, num_waiting, max_loras, active_loras
_State = tuple[int, int, int, int, int, tuple[str, ...]]


class LoadMetricsPublisher:
    def __init__(self, events_plane, instance_id: str, min_interval_s: float = MIN_INTERVAL_S,
                 keepalive_s: float = KEEPALIVE_S, clock=time.monotonic):
        self.events_plane = events_plane  # an EventPublisher: anything with publish(topic, message)
        self.instance_id = instance_id
        self.min_interval_s = min_interval_s
        self.keepalive_s = keepalive_s
        self._clock = clock
        self._sent: dict[int, _State] = {}  # rank -> last state published
        self._sent_at: dict[int, float] = {}
        self._held: dict[int, _State] = {}  # rank -> newer state waiting for its interval to end
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._keepalive: asyncio.Task | None = None
        self.published = 0

    def update(self, dp_rank: int, kv_active_blocks: int, kv_total_blocks: int, num_running: int,
               num_waiting: int, max_loras: int = 0, active_loras: tuple[str, ...] = ()) -> None:
        """The engine's current numbers for one rank; call as often as you like (cheap when unchanged).
        `max_loras`, `active_loras`: its LoRA slots and the adapters in them, least recently used first."""
        state = (kv_active_blocks, kv_total_blocks, num_running, num_waiting, max_loras, active_loras)
        if self._sent.get(dp_rank) == state:
            self._held.pop(dp_rank, None)  # back to what subscribers already have
            return
        if dp_rank in self._timers:
            self._held[dp_rank] = state  # the pending flush sends the latest
            return
        wait = self._sent_at.get(dp_rank, -self.min_interval_s) + self.min_interval_s - self._clock()
        if wait <= 0:
            self._send(dp_rank, state)
        else:
            self._held[dp_rank] = state
            self._timers[dp_rank] = asyncio.get_running_loop().call_later(wait, self._flush, dp_rank)
        if self._keepalive is None and self.keepalive_s > 0:
            self._keepalive = asyncio.get_running_loop().create_task(self._resend_idle())

    def _flush(self, dp_rank: int) -> None:
        del self._timers[dp_rank]
        state = self._held.pop(dp_rank, None)
        if state is not None:
            self._send(dp_rank, state)

    def _send(self, dp_rank: int, state: _State) -> None:
        active, total, running, waiting, max_loras, loras = state
        self.events_plane.publish(LOAD_METRICS_TOPIC, LoadMetrics(
            instance_id=self.instance_id, dp_rank=dp_rank, kv_active_blocks=active, kv_total_blocks=total,
            num_running=running, num_waiting=waiting, max_loras=max_loras, active_loras=list(loras)))
        self._sent[dp_rank] = state
        self._sent_at[dp_rank] = self._clock()
        self.published += 1

    async def _resend_idle(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s)
            now = self._clock()
            for rank, state in list(self._sent.items()):
                if now - self._sent_at[rank] >= self.keepalive_s and rank not in self._timers:
                    self._send(rank, state)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._keepalive is not None:
            self._keepalive.cancel()

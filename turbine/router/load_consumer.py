"""Feeds a KV router's load tracker with its workers' own load reports (LoadMetrics).

It follows the same publishers as the KV events consumer (the event-plane address in each
worker's model card) but subscribes to the load-metrics topic only. A worker without an
event plane sends no reports; the router then counts that worker's requests itself.
"""

from __future__ import annotations

import asyncio
import logging

from turbine.protocol.discovery import ModelCard
from turbine.protocol.load_metrics import LoadMetrics
from turbine.runtime.codec import decode
from turbine.runtime.errors import DecodeError
from turbine.runtime.event_plane import LOAD_METRICS_TOPIC, EventSubscriber
from turbine.router.cost import LoadTracker
from turbine.router.indexer import WorkerKey

log = logging.getLogger("turbine.router")


class LoadMetricsConsumer:
    def __init__(self, loads: LoadTracker):
        self.loads = loads
        self._sub = EventSubscriber(topics=(LOAD_METRICS_TOPIC,))
        self._address_of: dict[str, str] = {}  # instance id -> its publisher's address
        self._ranks: dict[str, set[int]] = {}  # instance id -> ranks it reported
        self._task: asyncio.Task | None = None
        self.received = 0
        self.rejected = 0

    def sync(self, cards: dict[str, ModelCard]) -> None:
        """Follow exactly the publishers of these instances (call on every discovery change)."""
        for instance_id in self._address_of.keys() - cards.keys():
            self._sub.disconnect(self._address_of.pop(instance_id))
            for rank in self._ranks.pop(instance_id, ()):
                self.loads.forget_worker(WorkerKey(instance_id, rank))
        for instance_id, card in cards.items():
            if card.kv_events_address is not None and instance_id not in self._address_of:
                self._address_of[instance_id] = card.kv_events_address
                self._sub.connect(card.kv_events_address)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            _topic, payload = await self._sub.recv()
            try:
                metrics = decode(payload, LoadMetrics)
            except DecodeError as exc:
                self.rejected += 1
                log.warning("undecodable load metrics dropped: %s", exc)
                continue
            self.apply(metrics)

    def apply(self, metrics: LoadMetrics) -> None:
        if metrics.instance_id not in self._address_of:
            return  # a worker we no longer follow
        self.received += 1
        self._ranks.setdefault(metrics.instance_id, set()).add(metrics.dp_rank)
        self.loads.report(WorkerKey(metrics.instance_id, metrics.dp_rank), metrics)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sub.close()

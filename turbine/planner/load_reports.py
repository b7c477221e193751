"""The workers' own load reports (LoadMetrics, every engine step, coalesced) on the event plane,
as the planner's load-based path reads them: the latest report of each engine (worker and
data-parallel rank) of the roles it plans, with when it came.

Subscribes like a KV router does (turbine/router/load_consumer.py): one connection per worker at
its model card's load-metrics address, through the router's subscriber."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from turbine.protocol.discovery import ModelCard
from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.runtime.codec import decode
from turbine.runtime.errors import DecodeError
from turbine.runtime.event_plane import LOAD_METRICS_TOPIC

log = logging.getLogger("turbine.planner")


@dataclass(frozen=True)
class EngineLoad:
    role: str  # the worker's disaggregation mode: agg, prefill or decode
    block_size: int  # its card's KV block size
    report: LoadMetrics
    at: float  # time.monotonic() when received


class LoadReports:
    def __init__(self, subscriber: RouterEventSubscriber | None = None):
        self._sub = subscriber or RouterEventSubscriber()
        self._sub.on(LOAD_METRICS_TOPIC, self.handle)
        self._cards: dict[str, ModelCard] = {}  # followed instance id -> its card
        self._address_of: dict[str, str] = {}
        self._latest: dict[tuple[str, int], EngineLoad] = {}
        self.received = 0
        self.rejected = 0

    def sync(self, cards: dict[str, ModelCard]) -> None:
        """Follow exactly these workers (instance id -> card); call on every discovery change."""
        for instance_id in self._address_of.keys() - cards.keys():
            self._sub.unfollow(self._address_of.pop(instance_id))
        for key in [k for k in self._latest if k[0] not in cards]:
            del self._latest[key]
        for instance_id, card in cards.items():
            address = card.load_metrics_address or card.kv_events_address
            if address is not None and instance_id not in self._address_of:
                try:
                    self._sub.follow(address)
                except ValueError as exc:
                    log.warning("worker %s: %s; its load reports are not followed", instance_id, exc)
                    continue
                self._address_of[instance_id] = address
        self._cards = dict(cards)

    def handle(self, payload: bytes) -> None:
        try:
            report = decode(payload, LoadMetrics)
        except DecodeError as exc:
            self.rejected += 1
            log.warning("undecodable load report dropped: %s", exc)
            return
        self.apply(report)

    def apply(self, report: LoadMetrics, now: float | None = None) -> None:
        card = self._cards.get(report.instance_id)
        if card is None or not 0 <= report.dp_rank < max(1, card.data_parallel_size):
            self.rejected += 1  # a worker we do not follow, or a rank its card does not have
            return
        self.received += 1
        self._latest[(report.instance_id, report.dp_rank)] = EngineLoad(
            card.disaggregation_mode, card.kv_block_size, report, time.monotonic() if now is None else now)

    def engines(self, max_age_s: float, now: float | None = None) -> list[EngineLoad]:
        """The latest report of every engine that reported within `max_age_s`."""
        now = time.monotonic() if now is None else now
        return [e for e in self._latest.values() if now - e.at <= max_age_s]

    def close(self) -> None:
        self._sub.release(self._address_of.values(), owner=True)
        self._address_of.clear()

"""Feeds a KV router's load tracker with its workers' own load reports (LoadMetrics).

Reports come from the router's event-plane subscriber (router/event_subscriber.py), shared with
the KV events consumer: this consumer follows every worker's load-metrics address (its model
card's) and handles the load-metrics topic. A worker whose card names none sends no reports;
the router then counts that worker's requests itself.
"""

from __future__ import annotations

import logging

from turbine.protocol.discovery import ModelCard
from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.cost import LoadTracker
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.router.indexer import WorkerKey
from turbine.runtime.codec import decode
from turbine.runtime.errors import DecodeError
from turbine.runtime.event_plane import LOAD_METRICS_TOPIC

log = logging.getLogger("turbine.router")

# More LoRA slots than any engine has: a report claiming more is hostile or broken (its adapter
# list would grow the tracker without bound).
MAX_LORA_SLOTS = 1024


class LoadMetricsConsumer:
    def __init__(self, loads: LoadTracker, subscriber: RouterEventSubscriber | None = None):
        """`subscriber`: the router's event-plane subscriber, shared with its other consumers
        (default: one of its own, closed with this consumer)."""
        self.loads = loads
        self._own_sub = subscriber is None
        self._sub = subscriber or RouterEventSubscriber()
        self._sub.on(LOAD_METRICS_TOPIC, self.handle)
        self._address_of: dict[str, str] = {}  # instance id -> its publisher's address
        self._ranks: dict[str, int] = {}  # instance id -> its data-parallel ranks (its card's)
        self._unfollowable: set[str] = set()  # instance ids whose address we cannot follow (warned once)
        self.received = 0
        self.rejected = 0

    def sync(self, cards: dict[str, ModelCard]) -> None:
        """Follow exactly the publishers of these instances (call on every discovery change)."""
        for instance_id in self._address_of.keys() - cards.keys():
            self._sub.unfollow(self._address_of.pop(instance_id))
            self._ranks.pop(instance_id, None)
            self.loads.forget_instance(instance_id)  # the reports of every rank it had
        self._unfollowable &= cards.keys()
        for instance_id, card in cards.items():
            # Every worker publishes load (load_metrics_address); older cards only name the
            # KV-events address, on which the same publisher sends it.
            address = card.load_metrics_address or card.kv_events_address
            if address is not None and instance_id not in self._address_of:
                try:
                    self._sub.follow(address)
                except ValueError as exc:  # e.g. a scheme we do not know
                    if instance_id not in self._unfollowable:
                        self._unfollowable.add(instance_id)
                        log.warning("worker %s: %s; its load reports are not followed", instance_id, exc)
                    continue
                self._address_of[instance_id] = address
            self._ranks[instance_id] = max(1, card.data_parallel_size)

    def handle(self, payload: bytes) -> None:
        """One message of the load-metrics topic, as received."""
        try:
            metrics = decode(payload, LoadMetrics)
        except DecodeError as exc:
            self.rejected += 1
            log.warning("undecodable load metrics dropped: %s", exc)
            return
        self.apply(metrics)

    def apply(self, metrics: LoadMetrics) -> None:
        if metrics.instance_id not in self._address_of:
            return  # a worker we no longer follow
        if not 0 <= metrics.dp_rank < self._ranks.get(metrics.instance_id, 1):
            # A rank its card does not have: kept, every made-up rank would grow the tracker (found by fuzzing).
            self.rejected += 1
            log.warning("load report of worker %s for dp rank %d dropped: its card has %d rank(s)",
                        metrics.instance_id, metrics.dp_rank, self._ranks.get(metrics.instance_id, 1))
            return
        if not 0 <= metrics.max_loras <= MAX_LORA_SLOTS or len(metrics.active_loras) > metrics.max_loras:
            self.rejected += 1
            log.warning("load report of worker %s dropped: %d active LoRA adapters for %d slots",
                        metrics.instance_id, len(metrics.active_loras), metrics.max_loras)
            return
        self.received += 1
        self.loads.report(WorkerKey(metrics.instance_id, metrics.dp_rank), metrics)

    def close(self) -> None:
        self._sub.release(self._address_of.values(), owner=self._own_sub)
        self._address_of.clear()

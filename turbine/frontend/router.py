"""Picks a worker instance for a request among a model's live instances."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from turbine.frontend.metrics import FrontendMetrics
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.router.kv_router import KvRouter, KvRouterConfig

ROUTER_MODES = ("round-robin", "random", "kv")


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "round-robin"
    kv_overlap_score_weight: float = 1.0
    temperature: float = 0.0
    kv_events: bool = True  # False: approximate KV routing, learned from our own decisions


class Router:
    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> InstanceRecord:
        raise NotImplementedError

    # Request lifecycle and fleet changes, for routers that keep state.
    def first_token(self, request_id: str) -> None:
        pass

    def finished(self, request_id: str) -> None:
        pass

    def instances_changed(self, live: list[InstanceRecord], cards: dict[str, ModelCard]) -> None:
        pass

    def export_metrics(self) -> None:
        """Copy this router's state into the frontend's gauges (called at scrape time)."""


class RoundRobinRouter(Router):
    def __init__(self):
        self._counter = itertools.count()

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> InstanceRecord:
        return instances[next(self._counter) % len(instances)]


class RandomRouter(Router):
    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> InstanceRecord:
        return random.choice(instances)


class KvAwareRouter(Router):
    """Routes to the instance that already holds most of the prompt's prefix, weighed against load."""

    def __init__(self, cfg: RouterConfig, model: str, block_size: int, metrics: FrontendMetrics):
        self.model = model
        self.metrics = metrics
        self.kv = KvRouter(KvRouterConfig(block_size=block_size, overlap_weight=cfg.kv_overlap_score_weight,
                                          temperature=cfg.temperature, use_kv_events=cfg.kv_events))
        self._known: set[str] = set()
        self._events = KvEventsConsumer(self.kv.index) if cfg.kv_events else None
        self._exported: set[str] = set()  # workers with an indexed-blocks series on /metrics

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> InstanceRecord:
        by_id = {i.instance_id: i for i in instances}
        decision = self.kv.decide(request.request_id, request.token_ids, [WorkerKey(i) for i in by_id],
                                  lora_name=None)
        m, model = self.metrics, self.model
        m.router_decisions.labels(model).inc()
        m.router_decision_seconds.labels(model).observe(decision.seconds)
        m.router_overlap.labels(model).observe(decision.overlap_ratio)
        return by_id[decision.worker.instance_id]

    def export_metrics(self) -> None:
        metrics, model, index = self.metrics, self.model, self.kv.index
        if isinstance(index, KvIndexer):
            for gone in self._exported - self._known:
                metrics.router_indexed_blocks.remove(model, gone)
            self._exported = set(self._known)
            for worker in self._known:
                metrics.router_indexed_blocks.labels(model, worker).set(index.blocks_of(WorkerKey(worker)))
            metrics.router_events.labels(model).set(index.events_applied)
        if self._events is not None:
            metrics.router_event_gaps.labels(model).set(self._events.gaps)

    def first_token(self, request_id: str) -> None:
        self.kv.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.kv.finished(request_id)

    def instances_changed(self, live: list[InstanceRecord], cards: dict[str, ModelCard]) -> None:
        ids = {i.instance_id for i in live}
        for gone in self._known - ids:
            self.kv.worker_left(WorkerKey(gone))
        self._known = ids
        if self._events is not None:
            self._events.sync(cards)


def make_router(cfg: RouterConfig, card: ModelCard, metrics: FrontendMetrics) -> Router:
    if cfg.mode == "round-robin":
        return RoundRobinRouter()
    if cfg.mode == "random":
        return RandomRouter()
    if cfg.mode == "kv":
        return KvAwareRouter(cfg, card.name, card.kv_block_size, metrics)
    raise ValueError(f"--router-mode {cfg.mode!r}: choose from {', '.join(ROUTER_MODES)}")

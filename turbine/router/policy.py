"""Routing policies: pick the worker (instance and data-parallel rank) for a request among a
model's live instances. Every process that routes (the frontend, the standalone router) uses
these; `make_router` builds one by its mode."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import NamedTuple

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.router.event_watchdog import DEFAULT_DEADLINE_S
from turbine.router.kv_router import DEFAULT_OVERLAP_WEIGHT, KvRouterConfig
from turbine.router.metrics import RouterMetrics
from turbine.router.model_router import ModelKvRouter

ROUTER_MODES = ("round-robin", "random", "kv")


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "round-robin"
    kv_overlap_score_weight: float = DEFAULT_OVERLAP_WEIGHT
    temperature: float = 0.0
    kv_events: bool = True  # False: approximate KV routing, learned from our own decisions
    kv_events_deadline_s: float = DEFAULT_DEADLINE_S  # expected KV events later than this: a warning


class Target(NamedTuple):
    """Where a request goes: an instance, and which of its engines (None: the worker picks)."""

    instance: InstanceRecord
    dp_rank: int | None = None


class Router:
    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
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

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        return Target(instances[next(self._counter) % len(instances)])


class RandomRouter(Router):
    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        return Target(random.choice(instances))


class KvAwareRouter(Router):
    """Routes to the instance that already holds most of the prompt's prefix, weighed against
    load. The routing itself is turbine.router's (shared with the standalone router service)."""

    def __init__(self, cfg: RouterConfig, model: str, block_size: int, metrics: RouterMetrics | None):
        self.core = ModelKvRouter(
            model, KvRouterConfig(block_size=block_size, overlap_weight=cfg.kv_overlap_score_weight,
                                  temperature=cfg.temperature, use_kv_events=cfg.kv_events),
            metrics, events_deadline_s=cfg.kv_events_deadline_s)

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        by_id = {i.instance_id: i for i in instances}
        decision = self.core.decide(request.request_id, request.token_ids, list(by_id))
        return Target(by_id[decision.worker.instance_id], decision.worker.dp_rank)

    def export_metrics(self) -> None:
        self.core.export_metrics()

    def first_token(self, request_id: str) -> None:
        self.core.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.core.finished(request_id)

    def instances_changed(self, live: list[InstanceRecord], cards: dict[str, ModelCard]) -> None:
        self.core.instances_changed(cards, {i.instance_id: i.address for i in live})


def make_router(cfg: RouterConfig, card: ModelCard, metrics: RouterMetrics | None = None) -> Router:
    if cfg.mode == "round-robin":
        return RoundRobinRouter()
    if cfg.mode == "random":
        return RandomRouter()
    if cfg.mode == "kv":
        return KvAwareRouter(cfg, card.name, card.kv_block_size, metrics)
    raise ValueError(f"--router-mode {cfg.mode!r}: choose from {', '.join(ROUTER_MODES)}")

"""Routing policies: pick the worker (instance and data-parallel rank) for a request among a
model's live instances. Every process that routes (the frontend, the standalone router) uses
these. Policies are found by name in a registry (`register_policy`, `router_modes`), which the
frontend's `--router-mode` choices come from; `make_router` builds one for a model."""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from turbine.config import check, config_errors_to, flag
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.router.config import KvRouterConfig, kv_router_config_from_args
from turbine.router.hashing import media_block_keys, media_keyed_ids, widen_images
from turbine.router.metrics import RouterMetrics
from turbine.router.model_router import ModelKvRouter


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


# The built-in policies' names; a policy registered later is valid too (RouterConfig checks the registry).
RouterMode = Literal["round-robin", "random", "kv"]


@dataclass(frozen=True)
class RouterConfig:
    mode: RouterMode = flag("--router-mode", default="round-robin")
    kv: KvRouterConfig = field(default_factory=KvRouterConfig)  # for policies that route by KV cache

    def __post_init__(self):
        check(self, self.mode in _POLICIES, "mode", f"{self.mode!r}: choose from {', '.join(router_modes())}")
        check(self, self.kv.use_kv_tiers or self.mode not in _BLIND_MODES, "mode",
              f"{self.mode} routing follows no KV events: --no-router-kv-tiers needs --router-mode kv")

    @property
    def follows_kv_events(self) -> bool:
        """Whether this routing reads the workers' KV events (a registered policy is assumed to)."""
        return self.mode not in _BLIND_MODES and self.kv.use_kv_events


_BLIND_MODES = ("round-robin", "random")  # the built-in policies that route by no worker's cache


# A policy: (config, the model's card, the host's router metrics or None) -> a Router for that model.
PolicyFactory = Callable[[RouterConfig, ModelCard, "RouterMetrics | None"], Router]
_POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy available by name (to make_router, RouterConfig and --router-mode)."""
    if name in _POLICIES:
        raise ValueError(f"router policy {name!r} is registered already")
    _POLICIES[name] = factory


def router_modes() -> tuple[str, ...]:
    return tuple(_POLICIES)


def make_router(cfg: RouterConfig, card: ModelCard, metrics: RouterMetrics | None = None) -> Router:
    return _POLICIES[cfg.mode](cfg, card, metrics)


def router_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterConfig:
    """--router-mode and the KV router's flags (add_kv_router_args) -> RouterConfig."""
    kv = kv_router_config_from_args(args, parser)
    with config_errors_to(parser):
        return RouterConfig(mode=args.router_mode, kv=kv)


# -- the built-in policies -------------------------------------------------------------
class RoundRobinRouter(Router):
    """dp_rank stays None: the worker balances its own engines."""

    def __init__(self):
        self._counter = itertools.count()

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        return Target(instances[next(self._counter) % len(instances)])


class RandomRouter(Router):
    """dp_rank stays None: the worker balances its own engines."""

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        return Target(random.choice(instances))


class KvAwareRouter(Router):
    """Routes to the worker (instance and data-parallel rank) that already holds most of the
    prompt's prefix, under the request's LoRA adapter, weighed against load. The routing itself
    is ModelKvRouter's (shared with the standalone router service)."""

    def __init__(self, cfg: KvRouterConfig, model: str, block_size: int, metrics: RouterMetrics | None,
                 image_token_id: int | None = None,
                 image_placeholder: tuple[list[int], tuple[int, int]] | None = None):
        self.core = ModelKvRouter(model, cfg, block_size, metrics)
        self.image_token_id = image_token_id  # the model's image placeholder (its card's), None: none known
        # What the engine widens image_token_id to, and the image's range in it (the card's; None: unknown)
        self.image_placeholder = image_placeholder

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        by_id = {i.instance_id: i for i in instances}
        ids, keys = self.hashed_ids(request)
        decision = self.core.decide(request.request_id, ids, list(by_id), request.lora_name, media_keys=keys)
        return Target(by_id[decision.worker.instance_id], decision.worker.dp_rank)

    def hashed_ids(self, request: GenerateRequest) -> tuple[list[int], list[int] | None]:
        """The token ids the router hashes for the request, and each full block's media key (None: none).
        Two different images behind the same text must not share a prefix: with the card's placeholder the
        prompt is widened as the engine widens it and each image's blocks carry its key, exactly as the
        worker's KV events give them; without it, the image keys go into the unwidened ids (media_keyed_ids),
        which match the events' blocks only up to the first image."""
        ids = request.token_ids
        if not request.images:
            return ids, None
        hashes = [image.hash for image in request.images]
        if self.image_placeholder is not None and self.image_token_id is not None \
                and ids.count(self.image_token_id) == len(hashes):
            ids, ranges = widen_images(ids, self.image_token_id, *self.image_placeholder)
            return ids, media_block_keys(ranges, hashes, len(ids), self.core.kv.block_size)
        return media_keyed_ids(ids, self.image_token_id, hashes), None

    def export_metrics(self) -> None:
        self.core.export_metrics()

    def first_token(self, request_id: str) -> None:
        self.core.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.core.finished(request_id)

    def instances_changed(self, live: list[InstanceRecord], cards: dict[str, ModelCard]) -> None:
        self.core.instances_changed(cards, {i.instance_id: i.address for i in live})


register_policy("round-robin", lambda cfg, card, metrics: RoundRobinRouter())
register_policy("random", lambda cfg, card, metrics: RandomRouter())
register_policy("kv", lambda cfg, card, metrics: KvAwareRouter(
    cfg.kv, card.name, card.kv_block_size, metrics, card.image_token_id,
    None if card.image_placeholder is None or card.image_placeholder_range is None
    else (card.image_placeholder, tuple(card.image_placeholder_range))))

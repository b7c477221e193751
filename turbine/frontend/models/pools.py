"""The global router: one frontend (one OpenAI endpoint) over several deployments, each a pool of workers
(`--pool NAME=NAMESPACE[@DISCOVERY]`, repeated): a namespace in this frontend's discovery, or in a
discovery of its own (another etcd, another host's file directory), so pools may be on different hosts.

A request goes to a pool that serves its model, then to a worker of that pool. The pool is the one
holding the cheapest worker by the KV router's cost (turbine/router/cost.py: the prompt's blocks that
worker would compute, weighed against its load, from the workers' own load reports and KV events), so
traffic splits by load and follows cached prefixes across pools; the worker is then the same router's
choice within the pool. A pool that lost all its workers is no candidate: new requests go to the others,
and requests it was serving migrate there (the frontend's --migration-limit). Per-pool metrics:
`turbine_frontend_pool_requests_total{model,pool}` (requests routed to each) and
`turbine_frontend_pool_workers{model,pool}` (its live workers); /health lists each pool's workers.

Why in the frontend, not a process in front of per-pool frontends: a request that loses its pool
mid-stream can continue elsewhere only where its tokens are known, and the frontend is where they are
(the continuation is the prompt plus the tokens generated so far, migration.py)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from turbine.config import DiscoveryConfig, make_registry
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.router.policy import KvAwareRouter, Router, Target

log = logging.getLogger("turbine.frontend")

POOL_FLAG = "--pool"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class PoolConfig:
    """One pool: its name (in metrics and /health), its workers' namespace, and the discovery it is
    found in (None: the frontend's own)."""

    name: str
    namespace: str
    discovery: DiscoveryConfig | None = None


def parse_pool(value: str, default_ttl: float = 10.0) -> PoolConfig:
    """"NAME=NAMESPACE", "NAME=NAMESPACE@file:DIR" or "NAME=NAMESPACE@etcd:HOST:PORT[,HOST:PORT]".
    ValueError naming what is wrong."""
    name, sep, rest = value.partition("=")
    if not sep or not _NAME.match(name):
        raise ValueError(f"{value!r}: expected NAME=NAMESPACE[@file:DIR|@etcd:HOST:PORT,...] (NAME of letters, "
                         f"digits, '-' and '_')")
    namespace, at, where = rest.partition("@")
    if not _NAME.match(namespace):
        raise ValueError(f"{value!r}: the namespace {namespace!r} must be letters, digits, '-' and '_'")
    if not at:
        return PoolConfig(name, namespace)
    kind, colon, target = where.partition(":")
    if kind == "file" and colon and target:
        return PoolConfig(name, namespace, DiscoveryConfig(backend="file", file_dir=target, ttl=default_ttl))
    if kind == "etcd" and colon and target:
        endpoints = tuple(e.strip().removeprefix("http://") for e in target.split(",") if e.strip())
        return PoolConfig(name, namespace, DiscoveryConfig(backend="etcd", etcd_endpoints=endpoints, ttl=default_ttl))
    raise ValueError(f"{value!r}: the discovery after '@' must be file:DIR or etcd:HOST:PORT[,HOST:PORT]")


def check_pools(pools: tuple[PoolConfig, ...]) -> str | None:
    """Why these pools cannot work together, or None."""
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        return "a pool name is given twice"
    places = [(p.namespace, p.discovery) for p in pools]
    if len(set(places)) != len(places):
        return "two pools are the same namespace in the same discovery"
    if len(pools) == 1:
        return "one pool is a plain frontend: give two or more (or --namespace)"
    return None


class PooledDiscovery:
    """Every pool's discovery watched at once: yields the pools' instances and cards together, each pool's
    filtered to its namespace, after every change; `pool_of` says which pool an instance is in."""

    def __init__(self, pools: tuple[PoolConfig, ...], default: DiscoveryConfig, default_registry):
        self.pools = pools
        self.pool_of: dict[str, str] = {}  # instance id -> pool name
        self._registries: dict[DiscoveryConfig | None, object] = {None: default_registry}
        for pool in pools:
            if pool.discovery is not None and pool.discovery not in self._registries:
                self._registries[pool.discovery] = make_registry(pool.discovery)
        self._snapshots: dict[DiscoveryConfig | None, tuple[list[InstanceRecord], list[ModelCard]]] = {}

    async def start(self) -> None:
        for key, registry in self._registries.items():
            if key is not None:
                await registry.backend.start()

    async def close(self) -> None:
        for key, registry in self._registries.items():
            if key is not None:
                await registry.backend.close()

    async def watch(self) -> AsyncIterator[tuple[list[InstanceRecord], list[ModelCard]]]:
        changed = asyncio.Queue()

        async def follow(key, registry) -> None:
            async for snapshot in registry.watch():
                self._snapshots[key] = snapshot
                changed.put_nowait(None)

        tasks = [asyncio.create_task(follow(k, r)) for k, r in self._registries.items()]
        try:
            while True:
                await changed.get()
                while not changed.empty():
                    changed.get_nowait()
                yield self._merged()
        finally:
            for task in tasks:
                task.cancel()

    def _merged(self) -> tuple[list[InstanceRecord], list[ModelCard]]:
        instances, cards, pool_of = [], [], {}
        for pool in self.pools:
            found, found_cards = self._snapshots.get(pool.discovery, ([], []))
            for rec in found:
                if rec.namespace == pool.namespace:
                    instances.append(rec)
                    pool_of[rec.instance_id] = pool.name
            cards += [c for c in found_cards if c.namespace == pool.namespace]
        self.pool_of.clear()
        self.pool_of.update(pool_of)
        return instances, cards


class PoolRouter(Router):
    """A model's routing over pools: the pool holding the cheapest worker by the KV router's cost, then
    that router's pick within the pool. `pool_of` is the frontend's live map (PooledDiscovery.pool_of)."""

    def __init__(self, inner: KvAwareRouter, pool_of: dict[str, str], pools: tuple[str, ...], model: str,
                 metrics=None):
        self.inner = inner
        self.pool_of = pool_of
        self.pools = pools  # every pool's name (each has its series, 0 workers included)
        self.model = model
        self.metrics = metrics  # FrontendMetrics (its pool families), or None
        self._workers: dict[str, int] = {}  # pool -> live workers

    def select(self, instances: list[InstanceRecord], request: GenerateRequest) -> Target:
        by_pool: dict[str, list[InstanceRecord]] = {}
        for inst in instances:
            by_pool.setdefault(self.pool_of.get(inst.instance_id, "?"), []).append(inst)
        if len(by_pool) == 1:
            pool = next(iter(by_pool))
        else:
            # The router's cost of every worker, as a query (not counted as a decision nor as load).
            ids, keys = self.inner.hashed_ids(request)
            core = self.inner.core
            decision = core.kv.decide(request.request_id, ids, core.workers([i.instance_id for i in instances]),
                                      request.lora_name, track=False, media_keys=keys)
            cost: dict[str, float] = {}
            for worker, value in decision.costs.items():
                p = self.pool_of.get(worker.instance_id, "?")
                cost[p] = min(value, cost.get(p, value))
            pool = min(by_pool, key=lambda p: cost.get(p, float("inf")))
        if self.metrics is not None:
            self.metrics.pool_requests.labels(self.model, pool).inc()
        return self.inner.select(by_pool[pool], request)

    def first_token(self, request_id: str) -> None:
        self.inner.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.inner.finished(request_id)

    def instances_changed(self, live: list[InstanceRecord], cards: dict[str, ModelCard]) -> None:
        self.inner.instances_changed(live, cards)
        workers: dict[str, int] = {}
        for inst in live:
            pool = self.pool_of.get(inst.instance_id, "?")
            workers[pool] = workers.get(pool, 0) + 1
        for pool in self._workers.keys() - workers.keys():
            log.warning("model %r: pool %r has no live worker any more; its requests go to the other pools",
                        self.model, pool)
        self._workers = workers

    def export_metrics(self) -> None:
        self.inner.export_metrics()
        if self.metrics is not None:
            for pool in self.pools:
                self.metrics.pool_workers.labels(self.model, pool).set(self._workers.get(pool, 0))

    def workers_per_pool(self) -> dict[str, int]:
        """Live workers of the model in each pool (0 for a pool that has none)."""
        return {pool: self._workers.get(pool, 0) for pool in self.pools}

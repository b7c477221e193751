"""The standalone KV router (`python -m turbine.router`): the frontend's KV routing decision as a
request-plane service, for components that pick workers themselves (e.g. prefill routing).

It follows discovery like the frontend does and keeps one KV router per (model, component) of
its namespace, fed by those workers' KV events and load reports. Endpoints: `best_worker`
(which instance should serve this prompt), `first_token` and `finished` (how a placed request
went, so that load accounting stays right). It registers itself under the component "router".
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import StatusReply
from turbine.protocol.router import (
    BEST_WORKER,
    FINISHED,
    FIRST_TOKEN,
    ROUTER_COMPONENT,
    BestWorkerReply,
    BestWorkerRequest,
    RequestNotice,
)
from turbine.router.args import RouterServiceConfig
from turbine.router.metrics import RouterMetrics
from turbine.router.model_router import ModelKvRouter

log = logging.getLogger("turbine.router")

EXPIRY_SWEEP_S = 30.0
_MAX_TOKEN_ID = (1 << 32) - 1  # block hashing packs token ids as u32

PoolKey = tuple[str, str]  # (model name, component)


class RouterService:
    def __init__(self, cfg: RouterServiceConfig, metrics: RouterMetrics | None = None):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.metrics = metrics
        self._routers: dict[PoolKey, ModelKvRouter] = {}
        # The live instances of each (model, component): instance id -> its generate endpoint's record.
        self._pools: dict[PoolKey, dict[str, InstanceRecord]] = {}
        self._placed: dict[str, tuple[ModelKvRouter, float]] = {}  # request id -> its router, when placed
        # LoRA adapters: (base model, component) -> adapter name -> the instances that hold it.
        self._holders: dict[PoolKey, dict[str, set[str]]] = {}
        self.registered = False

    # -- discovery --------------------------------------------------------------------
    def apply(self, instances: list[InstanceRecord], cards: list[ModelCard]) -> None:
        """A discovery snapshot: rebuild the pools, and tell each router its live workers (those on its
        request plane: the others could not be called by whoever asks it)."""
        by_path = {rec.path: rec for rec in instances if self.cfg.request_plane.serves(rec.address)}
        pools: dict[PoolKey, dict[str, InstanceRecord]] = {}
        pool_cards: dict[PoolKey, dict[str, ModelCard]] = {}
        holders: dict[PoolKey, dict[str, set[str]]] = {}
        for card in sorted(cards, key=lambda c: c.instance_id):
            if card.namespace != self.cfg.namespace:
                continue
            rec = by_path.get(card.path)
            if rec is None:
                continue  # the card outlived its instance record (or arrived first)
            if card.lora_name is not None:  # an adapter: routed by its base model's router, on its holders
                holders.setdefault((card.base_model or "", card.component), {}).setdefault(
                    card.lora_name, set()).add(card.instance_id)
                continue
            key = (card.name, card.component)
            pools.setdefault(key, {})[card.instance_id] = rec
            pool_cards.setdefault(key, {})[card.instance_id] = card
            if key not in self._routers:
                self._routers[key] = self._new_router(card)
        for key, router in self._routers.items():
            router.instances_changed(pool_cards.get(key, {}),
                                     {i: rec.address for i, rec in pools.get(key, {}).items()})
            if len(pools.get(key, ())) != len(self._pools.get(key, ())):
                log.info("model %r component %r: %d worker(s)", key[0], key[1], len(pools.get(key, ())))
        self._pools = pools
        self._holders = holders

    def _new_router(self, card: ModelCard) -> ModelKvRouter:
        return ModelKvRouter(card.name, self.cfg.kv, card.kv_block_size, self.metrics)

    # -- endpoints --------------------------------------------------------------------
    async def best_worker(self, req: BestWorkerRequest, ctx) -> AsyncIterator[BestWorkerReply]:
        try:
            yield self.choose(req)
        except ValueError as exc:
            yield BestWorkerReply(error=str(exc))

    async def first_token(self, req: RequestNotice, ctx) -> AsyncIterator[StatusReply]:
        placed = self._placed.get(req.request_id)
        if placed is None:
            yield StatusReply(status="error", message=f"unknown request_id {req.request_id!r}")
            return
        placed[0].first_token(req.request_id)
        yield StatusReply(status="success")

    async def finished(self, req: RequestNotice, ctx) -> AsyncIterator[StatusReply]:
        placed = self._placed.pop(req.request_id, None)
        if placed is None:
            yield StatusReply(status="error", message=f"unknown request_id {req.request_id!r}")
            return
        placed[0].finished(req.request_id)
        yield StatusReply(status="success")

    def choose(self, req: BestWorkerRequest) -> BestWorkerReply:
        """The decision; a request that cannot have one raises ValueError saying why."""
        if not req.token_ids:
            raise ValueError("token_ids is empty")
        if min(req.token_ids) < 0 or max(req.token_ids) > _MAX_TOKEN_ID:
            raise ValueError("token_ids: every token id must be between 0 and 2**32-1")
        model, lora_name = self._model_and_adapter(req)
        components = sorted(c for (m, c), pool in self._pools.items() if m == model and pool)
        if not components:
            raise ValueError(f"no live worker serves model {req.model!r} in namespace {self.cfg.namespace!r}")
        component = req.component
        if component is None:
            if len(components) > 1:
                raise ValueError(f"model {req.model!r} is served by components {', '.join(components)}: "
                                 "name one in 'component'")
            component = components[0]
        elif component not in components:
            raise ValueError(f"model {req.model!r} has no live worker in component {component!r} "
                             f"(it has: {', '.join(components)})")
        track = req.request_id is not None
        if track and req.request_id in self._placed:
            raise ValueError(f"request_id {req.request_id!r} is already placed (send 'finished' first)")
        key = (model, component)
        pool, router = self._pools[key], self._routers[key]
        if lora_name is not None:  # only the workers that hold the adapter
            held = self._holders.get(key, {}).get(lora_name, set())
            pool = {i: rec for i, rec in pool.items() if i in held}
            if not pool:
                raise ValueError(f"no live worker of model {model!r} in component {component!r} holds the LoRA "
                                 f"adapter {lora_name!r}")
        decision = router.decide(req.request_id or "", req.token_ids, list(pool), lora_name, track=track)
        if track:
            self._placed[req.request_id] = (router, time.monotonic())
        rec = pool[decision.worker.instance_id]
        return BestWorkerReply(instance_id=rec.instance_id, address=rec.address, endpoint=rec.endpoint,
                               component=component, dp_rank=decision.worker.dp_rank,
                               overlap_blocks=decision.overlap_blocks, prompt_blocks=decision.prompt_blocks)

    def _model_and_adapter(self, req: BestWorkerRequest) -> tuple[str, str | None]:
        """(base model, adapter) of a request: `model` may name an adapter (then it is the
        adapter), or the base model with `lora_name` naming one of its adapters."""
        bases = {m for (m, _c), by_name in self._holders.items() if req.model in by_name}
        if bases and not any(m == req.model for m, _c in self._pools):
            if req.lora_name is not None and req.lora_name != req.model:
                raise ValueError(f"model {req.model!r} is a LoRA adapter; lora_name {req.lora_name!r} contradicts it")
            if len(bases) > 1:
                raise ValueError(f"adapter {req.model!r} adapts several models ({', '.join(sorted(bases))})")
            return bases.pop(), req.model
        return req.model, req.lora_name

    def expire(self, now: float | None = None) -> int:
        """Stop counting placed requests whose `finished` never came within the TTL."""
        now = time.monotonic() if now is None else now
        old = [r for r, (_, at) in self._placed.items() if now - at > self.cfg.request_ttl_s]
        for request_id in old:
            router, _ = self._placed.pop(request_id)
            router.finished(request_id)
        if old:
            log.warning("%d placed request(s) got no 'finished' within %.0fs; they no longer count as load",
                        len(old), self.cfg.request_ttl_s)
        return len(old)

    def export_metrics(self) -> None:
        for router in self._routers.values():
            router.export_metrics()

    def close(self) -> None:
        for router in self._routers.values():
            router.close()

    # -- process ----------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        from turbine.config import make_registry
        from turbine.runtime.lifecycle import drain_and_stop
        from turbine.runtime.registration import advertised_address, unregister
        cfg = self.cfg
        server = cfg.request_plane.server(cfg.host, cfg.port)
        server.register(BEST_WORKER, BestWorkerRequest, self.best_worker)
        server.register(FIRST_TOKEN, RequestNotice, self.first_token)
        server.register(FINISHED, RequestNotice, self.finished)
        await server.start()
        registry = make_registry(cfg.discovery)
        await registry.backend.start()
        tasks = [asyncio.create_task(self._follow(registry)), asyncio.create_task(self._sweep())]
        try:
            address = advertised_address(server.address)
            records = [InstanceRecord(namespace=cfg.namespace, component=ROUTER_COMPONENT, endpoint=endpoint,
                                      instance_id=self.instance_id, address=address, pid=os.getpid(),
                                      hostname=socket.gethostname())
                       for endpoint in (BEST_WORKER, FIRST_TOKEN, FINISHED)]
            for rec in records:
                await registry.register_instance(rec)
            self.registered = True
            log.info("router %s serving %s at %s (namespace %r)", self.instance_id, BEST_WORKER, address,
                     cfg.namespace)
            await stopping.wait()
            await unregister(registry, records)
            await drain_and_stop([server], grace_s=5)
        finally:
            for task in tasks:
                task.cancel()
            self.close()
            await registry.backend.close()

    async def _follow(self, registry) -> None:
        async for instances, cards in registry.watch():
            try:
                self.apply(instances, cards)
            except Exception:  # a bad card must not stop the watcher
                log.exception("could not apply discovery snapshot")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            self.expire()


async def serve(cfg: RouterServiceConfig) -> int:
    from prometheus_client import REGISTRY

    from turbine.runtime.lifecycle import stop_on_signals
    from turbine.runtime.status_server import Health, make_app, serve_status

    from turbine.runtime import cluster_auth

    cluster_auth.install(cfg.security.auth())  # before any plane opens
    cfg.request_plane.install()  # its routers fetch workers' missed KV events on it
    stopping = asyncio.Event()
    stop_on_signals(stopping)
    service = RouterService(cfg, RouterMetrics(REGISTRY))  # its own process: the default registry
    status_server = None
    if cfg.system_port is not None:
        health = Health()

        async def registered() -> str | None:
            return None if service.registered else "not registered in discovery yet"

        health.set_ready(registered)
        status_server = await serve_status(make_app(health, service.export_metrics), cfg.system_host,
                                           cfg.system_port)
        log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)
    try:
        await service.run(stopping)
    finally:
        if status_server is not None:
            status_server.should_exit = True
    return 0


def main(argv: list[str] | None = None) -> int:
    from turbine.logging_setup import setup_logging
    from turbine.router.args import parse_router_args
    from turbine.tracing import setup_tracing

    setup_logging(argv, "python -m turbine.router")
    cfg = parse_router_args(argv)
    setup_tracing(argv, "turbine-router")
    return asyncio.run(serve(cfg))

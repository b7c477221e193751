"""LoRA adapters loaded at run time, the one place that orders it, for every engine kind:

load: name checked → (per-name lock) already loaded from the same source: answered as is, no
engine work (idempotent); from another source: refused → the source resolved to a local folder
(lora_sources.py) → the adapter checked (lora_check.py: config, rank, safetensors, base model's
shapes) → the engine adds it (`LoraEngine.add`) → its model card is published (a card of its
own, under the instance's path) — if that fails, the engine removes it again (rollback), so
nothing is ever half-registered.
unload: (same lock) the card is withdrawn → the engine removes it — if that fails, the card is
published again.

Loads of one name are serialized by its lock; different names proceed concurrently. Served on
each instance's request plane (`load_lora`, `unload_lora`, `list_loras`) and on the process's
status server (`POST /v1/loras`, `GET /v1/loras`, `DELETE /v1/loras/{name}`, on every instance
of the process or the one named by `instance_id`; the two that change state need the cluster
key when there is one). `list()` is what the worker holds now (routing may build on it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from turbine.protocol.discovery import ModelCard
from turbine.protocol.lora import (
    FAILED,
    INVALID,
    LIST_LORAS,
    LOAD_LORA,
    NOT_FOUND,
    UNLOAD_LORA,
    UNSUPPORTED,
    ListLorasReply,
    ListLorasRequest,
    LoadLoraRequest,
    LoraInfo,
    LoraReply,
    UnloadLoraRequest,
    lora_name_problem,
)
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.worker.lora_check import AdapterError, check_adapter
from turbine.worker.lora_sources import resolve_source
from turbine.worker.sleep import error_json, keyed_route, read_body
from turbine.worker.worker_metrics import WorkerMetrics

log = logging.getLogger("turbine.worker")

HTTP_STATUS = {INVALID: 400, NOT_FOUND: 404, UNSUPPORTED: 501, FAILED: 500}


class LoraEngine(Protocol):
    """What an engine kind gives the host for one instance's engine to take adapters."""

    def lora_refusal(self) -> str | None:
        """Why this engine takes no adapters (e.g. vLLM without --enable-lora), or None."""

    @property
    def max_lora_rank(self) -> int | None:
        """The largest adapter rank it takes (None: no limit)."""

    @property
    def base_model_dir(self) -> str | None:
        """The base model's local folder, to check adapters' shapes against (None: not local)."""

    async def add(self, name: str, lora_id: int, path: str) -> None:
        """Load the adapter at `path` (checked already); requests may use `name` once this returns.
        Raises AdapterError (the adapter is bad) or anything else (the engine failed); either way
        nothing is left loaded."""

    async def remove(self, name: str, lora_id: int) -> None:
        """Unload it; requests naming it are refused from now on."""


class NoLora:
    """The adapters of an engine that takes none."""

    max_lora_rank = None
    base_model_dir = None

    def __init__(self, reason: str):
        self.reason = reason

    def lora_refusal(self) -> str | None:
        return self.reason

    async def add(self, name: str, lora_id: int, path: str) -> None:
        raise AdapterError(self.reason)

    async def remove(self, name: str, lora_id: int) -> None:
        raise AdapterError(self.reason)


class AdapterCards(Protocol):
    """Where an instance's adapter cards are published (InstanceSleep, which owns its registration)."""

    async def publish_adapter(self, card: ModelCard) -> None: ...

    async def withdraw_adapter(self, card: ModelCard) -> None: ...


_ids = itertools.count(1)  # adapter ids, unique in the process (vLLM's lora_int_id must be > 0)


class LoraManager:
    """One instance's adapters."""

    def __init__(self, card: ModelCard, engine: LoraEngine, cards: AdapterCards,
                 metrics: WorkerMetrics | None = None, cache_dir: Path | None = None):
        self.card, self.engine, self.cards, self.metrics = card, engine, cards, metrics
        self.cache_dir = cache_dir
        self.loaded: dict[str, LoraInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def instance_id(self) -> str:
        return self.card.instance_id

    def list(self) -> list[LoraInfo]:
        return sorted(self.loaded.values(), key=lambda i: i.lora_name)

    def adapter_card(self, info: LoraInfo) -> ModelCard:
        """The adapter's card: the base card's (tokenizer, parsers, limits) under the adapter's name."""
        return msgspec.structs.replace(self.card, name=info.lora_name, lora_name=info.lora_name,
                                       lora_id=info.lora_id, base_model=self.card.name)

    async def load(self, name: str, uri: str) -> LoraReply:
        if problem := self._name_problem(name):
            return LoraReply(status="error", message=problem, lora_name=name, code=INVALID)
        if reason := self.engine.lora_refusal():
            return LoraReply(status="error", message=reason, lora_name=name, code=UNSUPPORTED)
        async with self._lock(name):
            have = self.loaded.get(name)
            if have is not None:
                if have.uri == uri:
                    return LoraReply(status="success", message=f"adapter {name!r} is loaded already",
                                     lora_name=name, lora_id=have.lora_id)
                return LoraReply(status="error", code=INVALID, lora_name=name, lora_id=have.lora_id,
                                 message=f"adapter {name!r} is loaded from {have.uri}; unload it first to load "
                                         f"it from {uri}")
            try:
                path = await asyncio.to_thread(resolve_source, uri, self.cache_dir)
                adapter = await asyncio.to_thread(check_adapter, path, max_rank=self.engine.max_lora_rank,
                                                  model_dir=self.engine.base_model_dir)
            except AdapterError as exc:
                return LoraReply(status="error", message=str(exc), lora_name=name, code=INVALID)
            info = LoraInfo(lora_name=name, lora_id=next(_ids), uri=uri, path=path, rank=adapter.rank)
            if self.metrics is not None:
                self.metrics.lora_engine_loads.inc()
            try:
                await self.engine.add(name, info.lora_id, path)
            except (AdapterError, ValueError) as exc:  # the engine's own checks refused it
                return LoraReply(status="error", message=f"the engine refused the adapter: {exc}", lora_name=name,
                                 code=INVALID)
            except Exception as exc:
                log.exception("instance %s: the engine failed to load adapter %r", self.instance_id, name)
                return LoraReply(status="error", message=f"the engine could not load the adapter: "
                                 f"{type(exc).__name__}: {exc}", lora_name=name, code=FAILED)
            try:
                await self.cards.publish_adapter(self.adapter_card(info))
            except Exception as exc:
                log.warning("instance %s: adapter %r's card could not be published (%s); removing it from the "
                            "engine again", self.instance_id, name, exc)
                await self._remove_quietly(info)
                return LoraReply(status="error", code=FAILED, lora_name=name,
                                 message=f"adapter {name!r} could not be published in discovery "
                                         f"({type(exc).__name__}: {exc}); it was unloaded again")
            self.loaded[name] = info
            self._gauge()
            log.info("instance %s: adapter %r loaded (id %d, rank %d) from %s", self.instance_id, name,
                     info.lora_id, info.rank, uri)
            return LoraReply(status="success", message=f"adapter {name!r} loaded", lora_name=name,
                             lora_id=info.lora_id)

    async def unload(self, name: str) -> LoraReply:
        if problem := self._name_problem(name):
            return LoraReply(status="error", message=problem, lora_name=name, code=INVALID)
        async with self._lock(name):
            info = self.loaded.get(name)
            if info is None:
                return LoraReply(status="error", message=f"no adapter {name!r} is loaded", lora_name=name,
                                 code=NOT_FOUND)
            card = self.adapter_card(info)
            try:
                await self.cards.withdraw_adapter(card)  # first: no router sends it here any more
            except Exception as exc:
                return LoraReply(status="error", code=FAILED, lora_name=name, lora_id=info.lora_id,
                                 message=f"adapter {name!r}'s card could not be withdrawn from discovery "
                                         f"({type(exc).__name__}: {exc}); it stays loaded")
            try:
                await self.engine.remove(name, info.lora_id)
            except Exception as exc:
                log.warning("instance %s: the engine failed to unload adapter %r (%s); publishing it again",
                            self.instance_id, name, exc)
                try:
                    await self.cards.publish_adapter(card)
                except Exception:
                    log.exception("instance %s: adapter %r's card could not be published again", self.instance_id,
                                  name)
                return LoraReply(status="error", code=FAILED, lora_name=name, lora_id=info.lora_id,
                                 message=f"the engine could not unload adapter {name!r}: {type(exc).__name__}: "
                                         f"{exc}; it stays loaded")
            del self.loaded[name]
            self._gauge()
            log.info("instance %s: adapter %r unloaded", self.instance_id, name)
            return LoraReply(status="success", message=f"adapter {name!r} unloaded", lora_name=name,
                             lora_id=info.lora_id)

    def _name_problem(self, name: str) -> str | None:
        if problem := lora_name_problem(name):
            return problem
        if name == self.card.name:
            return f"lora_name {name!r} is the base model's name"
        return None

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def _remove_quietly(self, info: LoraInfo) -> None:
        try:
            await self.engine.remove(info.lora_name, info.lora_id)
        except Exception:
            log.exception("instance %s: adapter %r could not be removed from the engine in the rollback",
                          self.instance_id, info.lora_name)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.loras_loaded.set(len(self.loaded))

    # -- request plane ------------------------------------------------------------------
    def serve(self, server: RequestPlaneServer) -> None:
        server.register(LOAD_LORA, LoadLoraRequest, self._load_endpoint)
        server.register(UNLOAD_LORA, UnloadLoraRequest, self._unload_endpoint)
        server.register(LIST_LORAS, ListLorasRequest, self._list_endpoint)

    async def _load_endpoint(self, req: LoadLoraRequest, ctx) -> AsyncIterator[LoraReply]:
        yield await self.load(req.lora_name, req.source.uri)

    async def _unload_endpoint(self, req: UnloadLoraRequest, ctx) -> AsyncIterator[LoraReply]:
        yield await self.unload(req.lora_name)

    async def _list_endpoint(self, req: ListLorasRequest, ctx) -> AsyncIterator[ListLorasReply]:
        yield ListLorasReply(loras=self.list())


class LoraControls:
    """Every instance's adapters (filled as they start) and the status server's routes over them."""

    def __init__(self):
        self.managers: list[LoraManager] = []

    def routes(self) -> list[Route]:
        return [Route("/v1/loras", keyed_route(self._load), methods=["POST"]),
                Route("/v1/loras", self._list, methods=["GET"]),
                Route("/v1/loras/{name}", keyed_route(self._unload), methods=["DELETE"])]

    def _chosen(self, instance_id: str | None) -> list[LoraManager] | JSONResponse:
        chosen = self.managers if instance_id is None else [m for m in self.managers if m.instance_id == instance_id]
        if not chosen:
            return error_json(404 if self.managers else 503, "no such instance" if self.managers else "starting")
        return chosen

    async def _load(self, request: Request) -> JSONResponse:
        body, instance_id, error = await read_body(request)
        if error is not None:
            return error
        try:
            req = msgspec.convert(body, LoadLoraRequest)
        except msgspec.ValidationError as exc:
            return error_json(400, f"bad load request: {exc}")
        chosen = self._chosen(instance_id)
        if isinstance(chosen, JSONResponse):
            return chosen
        return _combined(chosen, await asyncio.gather(*(m.load(req.lora_name, req.source.uri) for m in chosen)))

    async def _unload(self, request: Request) -> JSONResponse:
        body, instance_id, error = await read_body(request)
        if error is not None:
            return error
        if body:
            return error_json(400, f"bad unload request: unknown field(s) {', '.join(sorted(body))}")
        chosen = self._chosen(instance_id or request.query_params.get("instance_id"))
        if isinstance(chosen, JSONResponse):
            return chosen
        name = request.path_params["name"]
        return _combined(chosen, await asyncio.gather(*(m.unload(name) for m in chosen)))

    async def _list(self, request: Request) -> JSONResponse:
        chosen = self._chosen(request.query_params.get("instance_id"))
        if isinstance(chosen, JSONResponse):
            return chosen
        loras = [{**msgspec.to_builtins(info), "instance_id": m.instance_id} for m in chosen for info in m.list()]
        return JSONResponse({"status": "success", "loras": loras})


def _combined(chosen: list[LoraManager], replies: list[LoraReply]) -> JSONResponse:
    """One instance's reply as the body (plus `instances`); the first error decides the status."""
    failed = next((r for r in replies if r.status != "success"), None)
    first = failed or replies[0]
    body = {k: v for k, v in msgspec.to_builtins(first).items() if k != "v"}
    body["instances"] = {m.instance_id: msgspec.to_builtins(r) for m, r in zip(chosen, replies)}
    return JSONResponse(body, status_code=200 if failed is None else HTTP_STATUS.get(failed.code, 500))

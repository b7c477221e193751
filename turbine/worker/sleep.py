"""Sleep / wake of a served instance, the one place that orders it:

sleep: refuse at once if the engine cannot sleep → unregister (no frontend routes here any
more) → in-flight requests, and any routed here before the frontends noticed, finish within the
drain timeout; those still running then fail as shutting_down (retryable: a frontend re-issues
them elsewhere) → new requests are refused as shutting_down → the engine sleeps (level 1: KV
cache freed; 2: weights too).
wake: the engine wakes → requests are served again → register (routed to again).

Served on each instance's request plane (`sleep`, `wake_up`, `is_sleeping`) and on the
process's status server (`POST /engine/sleep`, `POST /engine/wake_up`, `GET /engine/is_sleeping`,
acting on every instance of the process, or on the one named by `instance_id`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from turbine.protocol import errors as codes
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.embed import EMBED_ENDPOINT
from turbine.protocol.errors import WorkerError
from turbine.protocol.sleep import SLEEP_LEVELS, IsSleepingRequest, SleepReply, SleepRequest, WakeUpRequest
from turbine.runtime import cluster_auth
from turbine.runtime.discovery.registry import Registry
from turbine.runtime.registration import advertised_address, register, unregister
from turbine.runtime.request_plane import RequestPlaneServer

log = logging.getLogger("turbine.worker")

SLEEP, WAKE_UP, IS_SLEEPING = "sleep", "wake_up", "is_sleeping"


class SleepUnsupported(Exception):
    """The engine cannot sleep (its message says why); nothing was changed."""


class EngineSleep(Protocol):
    """What an engine kind gives the host for one instance's engine."""

    def sleep_refusal(self, level: int) -> str | None:
        """Why this engine cannot sleep at `level`, or None if it can."""

    async def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) and the weights (level 2); no request is running."""

    async def wake_up(self) -> None:
        """Restore what sleep freed; the engine serves again after this returns."""


class InstanceSleep:
    """One registered instance's sleep state and the sequence that changes it."""

    def __init__(self, server: RequestPlaneServer, card: ModelCard, engine: EngineSleep, registry: Registry,
                 drain_timeout: float, on_change: Callable[[], None] = lambda: None):
        self.server, self.card, self.engine, self.registry = server, card, engine, registry
        self.records: list[InstanceRecord] = []
        # Cards of the LoRA adapters loaded here (adapter name -> card): published with the
        # instance, withdrawn with it.
        self.adapter_cards: dict[str, ModelCard] = {}
        self.drain_timeout = drain_timeout  # default: the worker's --graceful-shutdown-timeout
        self.on_change = on_change
        self.level = 0  # 0: awake
        self.closed = False  # the process is stopping: no more wake-ups (no registering again)
        self._lock = asyncio.Lock()
        self._served = {card.endpoint, EMBED_ENDPOINT}  # request endpoints (not this control)

    @property
    def instance_id(self) -> str:
        return self.card.instance_id

    def reply(self, message: str, status: str = "success") -> SleepReply:
        return SleepReply(status=status, message=message, is_sleeping=self.level > 0, level=self.level)

    async def sleep(self, level: int = 1, drain_timeout: float | None = None) -> SleepReply:
        """Raises SleepUnsupported (nothing changed) when the engine cannot sleep, ValueError
        for a bad level or timeout."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level {level}: choose from {', '.join(map(str, SLEEP_LEVELS))}")
        if drain_timeout is not None and drain_timeout < 0:
            raise ValueError(f"drain_timeout {drain_timeout}: must be >= 0")
        if reason := self.engine.sleep_refusal(level):
            raise SleepUnsupported(reason)
        async with self._lock:
            if self.level:
                return self.reply(f"already sleeping (level {self.level})")
            # Out of discovery first: routers stop sending here before anything else changes. The card
            # stays, marked asleep: a frontend then knows the model exists (503, not 404) while all sleep.
            await self.unregister()
            await self._publish_asleep()
            # Requests routed here before the frontends saw us go are still served (the drain
            # waits for them too); from here on none is routed here.
            timeout = self.drain_timeout if drain_timeout is None else drain_timeout
            drained = await self.server.drain_endpoints(self._served, timeout)
            for endpoint in self._served:
                self.server.refuse(endpoint, WorkerError.of(codes.SHUTTING_DOWN, "the worker is asleep"))
            if not drained:
                failed = await self.server.fail_streams(
                    self._served, WorkerError.of(codes.SHUTTING_DOWN, "the worker went to sleep"))
                log.warning("instance %s: %d request(s) still running after %.1fs; failed as shutting_down",
                            self.instance_id, failed, timeout)
            try:
                await self.engine.sleep(level)
            except BaseException:
                await self._serve_again()  # the engine is awake still: keep serving
                raise
            self.level = level
            self.on_change()
            log.info("instance %s asleep (level %d)", self.instance_id, level)
            return self.reply(f"asleep (level {level})")

    async def wake_up(self) -> SleepReply:
        async with self._lock:
            if not self.level:
                return self.reply("already awake")
            if self.closed:
                return self.reply("the worker is stopping: it stays asleep", status="error")
            await self.engine.wake_up()
            self.level = 0
            await self._serve_again()
            self.on_change()
            log.info("instance %s awake and registered", self.instance_id)
            return self.reply("awake")

    async def register(self) -> None:
        """Publish the instance (its server is listening): from now on it is routed to. Its
        adapters' cards follow the base card."""
        self.records = await register(self.registry, self.card, advertised_address(self.server.address))
        for card in list(self.adapter_cards.values()):
            await self.registry.register_model(card)

    async def unregister(self) -> None:
        if self.records:
            for card in list(self.adapter_cards.values()):
                try:
                    await self.registry.unregister_model(card)
                except Exception as exc:  # discovery down: the TTL removes it anyway
                    log.warning("could not withdraw the card of adapter %r: %s", card.lora_name, exc)
        await unregister(self.registry, self.records)
        self.records = []

    async def _publish_asleep(self) -> None:
        try:
            await self.registry.register_model(msgspec.structs.replace(self.card, sleeping=True))
        except Exception as exc:  # discovery down: a frontend says 404 rather than 503 meanwhile
            log.warning("instance %s: could not mark its card asleep: %s", self.instance_id, exc)

    async def publish_adapter(self, card: ModelCard) -> None:
        """An adapter loaded here: its card goes out now if the instance is registered (else
        with the instance's registration). Raises if discovery refuses it (nothing kept)."""
        if self.records:
            try:
                await self.registry.register_model(card)
            except BaseException:
                with contextlib.suppress(Exception):  # the backend may keep it to re-put: not so
                    await self.registry.unregister_model(card)
                raise
        self.adapter_cards[card.lora_name] = card

    async def withdraw_adapter(self, card: ModelCard) -> None:
        """An adapter about to be unloaded: its card goes. Raises if discovery fails (kept)."""
        if self.records:
            await self.registry.unregister_model(card)
        self.adapter_cards.pop(card.lora_name, None)

    async def _serve_again(self) -> None:
        for endpoint in self._served:
            self.server.refuse(endpoint, None)
        if not self.closed:
            await self.register()

    def serve(self) -> None:
        """The request-plane endpoints (on the instance's own server)."""
        self.server.register(SLEEP, SleepRequest, self._sleep_endpoint)
        self.server.register(WAKE_UP, WakeUpRequest, self._wake_endpoint)
        self.server.register(IS_SLEEPING, IsSleepingRequest, self._is_sleeping_endpoint)

    async def _sleep_endpoint(self, req: SleepRequest, ctx) -> AsyncIterator[SleepReply]:
        try:
            yield await self.sleep(req.level, req.drain_timeout)
        except (SleepUnsupported, ValueError) as exc:
            yield self.reply(str(exc), status="error")

    async def _wake_endpoint(self, req: WakeUpRequest, ctx) -> AsyncIterator[SleepReply]:
        yield await self.wake_up()

    async def _is_sleeping_endpoint(self, req: IsSleepingRequest, ctx) -> AsyncIterator[SleepReply]:
        yield self.reply("asleep" if self.level else "awake")


class CannotSleep:
    """The sleep of an engine kind that has none."""

    def __init__(self, reason: str):
        self.reason = reason

    def sleep_refusal(self, level: int) -> str | None:
        return self.reason

    async def sleep(self, level: int) -> None:
        raise SleepUnsupported(self.reason)

    async def wake_up(self) -> None:
        raise SleepUnsupported(self.reason)


class SleepControls:
    """Every instance of the process (filled as they start) and the status server's routes
    over them."""

    def __init__(self):
        self.instances: list[InstanceSleep] = []

    async def register_all(self) -> None:
        for instance in self.instances:
            await instance.register()

    async def unregister_all(self) -> None:
        """The process is stopping: out of discovery for good (a wake-up no longer registers)."""
        for instance in self.instances:
            instance.closed = True
        for instance in self.instances:
            await instance.unregister()

    @property
    def all_asleep(self) -> bool:
        return bool(self.instances) and all(i.level for i in self.instances)

    def routes(self) -> list[Route]:
        return [Route("/engine/sleep", keyed_route(self._sleep), methods=["POST"]),
                Route("/engine/wake_up", keyed_route(self._wake_up), methods=["POST"]),
                Route("/engine/is_sleeping", self._is_sleeping, methods=["GET"])]

    def _chosen(self, instance_id: str | None) -> list[InstanceSleep]:
        if instance_id is None:
            return self.instances
        return [i for i in self.instances if i.instance_id == instance_id]

    async def _sleep(self, request: Request) -> JSONResponse:
        body, instance_id, error = await read_body(request)
        if error is not None:
            return error
        try:
            req = msgspec.convert(body, SleepRequest)
        except msgspec.ValidationError as exc:
            return error_json(400, f"bad sleep request: {exc}")
        return await self._each(instance_id, lambda i: i.sleep(req.level, req.drain_timeout))

    async def _wake_up(self, request: Request) -> JSONResponse:
        body, instance_id, error = await read_body(request)
        if error is not None:
            return error
        if body:
            return error_json(400, f"bad wake_up request: unknown field(s) {', '.join(sorted(body))}")
        return await self._each(instance_id, lambda i: i.wake_up())

    async def _is_sleeping(self, request: Request) -> JSONResponse:
        chosen = self._chosen(request.query_params.get("instance_id"))
        if not chosen:
            return error_json(404 if self.instances else 503, "no such instance" if self.instances else "starting")
        return JSONResponse({"is_sleeping": all(i.level for i in chosen),
                             "instances": {i.instance_id: i.level for i in chosen}})

    async def _each(self, instance_id: str | None, action) -> JSONResponse:
        chosen = self._chosen(instance_id)
        if not chosen:
            return error_json(404 if self.instances else 503, "no such instance" if self.instances else "starting")
        try:
            replies = await asyncio.gather(*(action(i) for i in chosen))
        except SleepUnsupported as exc:
            return error_json(501, str(exc))
        except ValueError as exc:
            return error_json(400, str(exc))
        status = 200 if all(r.status == "success" for r in replies) else 409
        return JSONResponse({"status": "success" if status == 200 else "error",
                             "instances": {i.instance_id: msgspec.to_builtins(r) for i, r in zip(chosen, replies)}},
                            status_code=status)


def keyed_route(handler):
    """A state-changing route: with a cluster key, only a caller that presents it (as a bearer
    token) may act; anyone who can reach the status port could otherwise take a worker out."""
    async def checked(request: Request) -> JSONResponse:
        if not cluster_auth.current().allows_control(request.headers.get("authorization")):
            return error_json(401, "this worker has a cluster key: send it as 'Authorization: Bearer <key>'")
        return await handler(request)
    return checked


async def read_body(request: Request) -> tuple[dict, str | None, JSONResponse | None]:
    raw = await request.body()
    if not raw.strip():
        return {}, None, None
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return {}, None, error_json(400, f"body is not JSON: {exc}")
    if not isinstance(body, dict):
        return {}, None, error_json(400, "body must be a JSON object")
    instance_id = body.pop("instance_id", None)
    if instance_id is not None and not isinstance(instance_id, str):
        return {}, None, error_json(400, "instance_id must be a string")
    return body, instance_id, None


def error_json(status: int, message: str) -> JSONResponse:
    return JSONResponse({"status": "error", "message": message}, status_code=status)

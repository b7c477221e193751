"""The worker host: the one sequence every worker-kind process runs around its engine(s).

Start: signal handling, status server (/live answers while the engine builds), the engine kind
builds its engine(s), event plane, the engine's instances (built by the engine kind), their request-plane servers,
then registration (instance records, then the model card: only then is an instance routed
to) and readiness (a canary proves the engine).
While serving: the engine's death ends the process (EXIT_ENGINE_DEAD); an instance may sleep
and wake (sleep.py: out of discovery while asleep).
Stop (SIGTERM/SIGINT or engine death): not ready, unregister first so no new traffic comes,
let in-flight requests finish within the grace period (none after engine death), close all.
Checkpoint mode (TURBINE_SNAPSHOT_CONTROL_DIR, snapshot.py): after the build the engine is
quiesced and the process waits to be checkpointed before it opens any socket (the status
server too); a restored copy wakes its engine, takes its new identity and goes on from the
status server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import uvloop

from turbine.config import make_registry
from turbine.protocol.discovery import ModelCard
from turbine.runtime import cluster_auth
from turbine.runtime.errors import EventPlaneError
from turbine.runtime.event_plane import WorkerEventPlane
from turbine.runtime.gc_pacing import freeze_start_up_heap
from turbine.runtime.lifecycle import UNREGISTER_SETTLE_S, drain_and_stop, stop_on_signals
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.status_server import Health, make_app, serve_status
from turbine.worker.config import ServingConfig
from turbine.worker.lora import LoraControls, LoraEngine, LoraManager, NoLora
from turbine.worker.sleep import CannotSleep, EngineSleep, InstanceSleep, SleepControls
from turbine.worker.snapshot import (
    RESTORE_COMPLETE,
    SNAPSHOT_CONTROL_DIR_ENV,
    RestoredIdentity,
    SnapshotControl,
    SnapshotError,
)

log = logging.getLogger("turbine.worker")

EXIT_BAD_CONFIG = 2  # as argparse: a flag names something unusable (e.g. --nats-server)
EXIT_ENGINE_DEAD = 3


@dataclass
class Instance:
    """One served instance: its request-plane server (endpoints registered, not started yet),
    its model card, how its engine sleeps (None: it cannot), how it takes LoRA adapters (None:
    it takes none) and the metrics its adapters are counted in."""

    server: RequestPlaneServer
    card: ModelCard
    sleep: EngineSleep | None = None
    lora: LoraEngine | None = None
    metrics: object | None = None  # its WorkerMetrics


class EngineKind(Protocol):
    """What an engine kind (vLLM, the mocker) gives the host."""

    async def build(self, *, checkpoint: bool) -> None:
        """Build what needs no socket (checkpoint mode: before any is opened); may do nothing. `checkpoint`: in
        checkpoint mode (the engine is built to be dumped and restored)."""

    def checkpoint_refusal(self) -> str | None:
        """Why this engine kind cannot run in checkpoint mode, or None if it can."""

    async def quiesce(self) -> None:
        """Checkpoint mode, after build(): still the engine(s): nothing running, nothing cached (a sleep where
        the engine has a sleep mode), and close whatever build() opened."""

    async def resume(self) -> None:
        """Checkpoint mode, restored: wake the engine(s) up."""

    def restore_identity(self, identity: RestoredIdentity) -> None:
        """Checkpoint mode, restored: register under this identity (before start())."""

    async def start(self, plane: WorkerEventPlane, health: Health) -> list[Instance]:
        """Start the engine(s) and build the instances served (the plane is open already)."""

    async def canary(self) -> str | None:
        """Generate a token on every engine: None when healthy, else why not."""

    def failure(self) -> str | None:
        """A reason the engine is unusable right now (checked on every health probe), or None."""

    async def died(self) -> str:
        """Returns (the reason) when the engine dies; runs until then."""

    def refresh_gauges(self) -> None:
        """Bring the engine's gauges up to date (a /metrics scrape)."""

    def serving(self) -> None:
        """Called once every instance is registered and ready (e.g. to log where it serves)."""

    async def close(self) -> None:
        """Stop the engine(s) and whatever start() opened."""


class WorkerHost:
    def __init__(self, cfg: ServingConfig, engine: EngineKind):
        self.cfg = cfg
        self.engine = engine
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.health = Health()
        self.loras = LoraControls()  # every instance's LoRA adapters (the status routes)
        self._engine_closed = False

    async def run(self) -> int:
        cluster_auth.install(self.cfg.security.auth())  # before any plane opens
        self.cfg.request_plane_config.install()
        stop_on_signals(self.stopping)
        try:
            snapshot = SnapshotControl.from_env()
        except SnapshotError as exc:
            log.error("%s", exc)
            return EXIT_BAD_CONFIG
        if snapshot is not None and (reason := self.engine.checkpoint_refusal()):
            log.error("%s is set but %s", SNAPSHOT_CONTROL_DIR_ENV, reason)
            return EXIT_BAD_CONFIG
        controls = SleepControls()
        status_server = None
        try:
            # /live answers while a (long) engine build runs, except in checkpoint mode, where no
            # socket may be open before the checkpoint.
            if snapshot is None:
                status_server = await self._serve_status(controls)
            await self.engine.build(checkpoint=snapshot is not None)
            if snapshot is not None:
                if not await self._checkpoint(snapshot):
                    return self.exit_code
                status_server = await self._serve_status(controls)
            return await self._serve(controls)
        finally:
            if status_server is not None:
                status_server.should_exit = True
            await self._close_engine()

    async def _serve_status(self, controls: SleepControls):
        cfg = self.cfg
        if cfg.system_port is None:
            return None
        app = make_app(self.health, self.engine.refresh_gauges, routes=[*controls.routes(), *self.loras.routes()])
        status_server = await serve_status(app, cfg.system_host, cfg.system_port)
        log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)
        return status_server

    async def _close_engine(self) -> None:
        if not self._engine_closed:
            self._engine_closed = True
            await self.engine.close()

    async def _checkpoint(self, control: SnapshotControl) -> bool:
        """Quiesce, say ready, wait for the verdict: True when restored (serve on), False when
        the checkpoint was taken (or we were told to stop): exit without ever registering."""
        await self.engine.quiesce()
        try:
            control.ready()
            log.info("ready for checkpoint; waiting for snapshot-complete or restore-complete in %s", control.dir)
            stop = asyncio.create_task(self.stopping.wait())
            verdict = asyncio.create_task(control.wait())
            await asyncio.wait([stop, verdict], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            verdict.cancel()
            restored = verdict.done() and not verdict.cancelled() and verdict.result() == RESTORE_COMPLETE
        finally:
            control.clear()
        if not restored:
            log.info("checkpoint taken (or stopped while waiting): exiting")
            return False
        await self.engine.resume()
        identity = control.restored_identity()
        self.engine.restore_identity(identity)
        log.info("restored: serving as %s", identity)
        return True

    async def _serve(self, controls: SleepControls) -> int:
        cfg, engine, health = self.cfg, self.engine, self.health
        plane = None
        registry = None
        nats_link = None
        try:
            # Before the engine: an unreachable NATS server fails the start at once.
            plane = await WorkerEventPlane.open(cfg.event_plane, cfg.host, cfg.nats_server)
            if cfg.request_plane == "nats":  # (the request-plane servers share this connection)
                from turbine.runtime.request_plane_nats import NatsLink

                nats_link = await NatsLink.acquire(cfg.nats_server)
            instances = await engine.start(plane, health)
            # The engine's start-up heap (torch, vLLM, the model's objects) lives as long as the process: out of
            # every later collector pass, whose full scans of it stalled every stream at once (as `vllm serve`
            # freezes its own).
            freeze_start_up_heap()
            registry = make_registry(cfg.discovery)
            await registry.backend.start()
            on_change = lambda: setattr(health, "sleeping", controls.all_asleep)  # noqa: E731
            for i in instances:
                sleeper = InstanceSleep(i.server, i.card, i.sleep or CannotSleep("this engine kind cannot sleep"),
                                        registry, cfg.graceful_shutdown_timeout, on_change)
                sleeper.serve()
                controls.instances.append(sleeper)
                loras = LoraManager(i.card, i.lora or NoLora("this worker kind takes no LoRA adapters"), sleeper,
                                    i.metrics)
                loras.serve(i.server)
                self.loras.managers.append(loras)
            # --lora-modules: loaded before registration, so their cards go out with the instance.
            if not await self._load_start_adapters():
                return self.exit_code
            servers = [i.server for i in instances]
            for server in servers:
                await server.start()
            await controls.register_all()
            health.set_ready(engine.canary, failure=engine.failure)
            first_check = asyncio.create_task(self._first_health_check())
            monitor = asyncio.create_task(engine.died())
            monitor.add_done_callback(self._engine_died)
            engine.serving()
            await self.stopping.wait()
            first_check.cancel()
            monitor.remove_done_callback(self._engine_died)
            monitor.cancel()
            health.set_not_ready()
            # Unregister first so no new traffic arrives, then let in-flight requests finish.
            await controls.unregister_all()
            await drain_and_stop(servers, cfg.graceful_shutdown_timeout if self.exit_code == 0 else 0,
                                 settle_s=UNREGISTER_SETTLE_S)
        finally:
            if registry is not None:
                await registry.backend.close()
            await self._close_engine()  # before the plane its publishers use
            if plane is not None:
                await plane.close()
            if nats_link is not None:
                await nats_link.release()
        return self.exit_code

    async def _first_health_check(self) -> None:
        """The canary once at start, so that a payload the engine refuses is in the log at once (and
        /health answers 503 naming why until the canary passes)."""
        status, reason = await self.health.check()
        if status == "healthy":
            log.info("health check passed (the canary went through the worker's request path)")
        elif reason is not None:
            log.warning("health check failed at start: %s; /health answers 503 until it passes", reason)

    async def _load_start_adapters(self) -> bool:
        for name, uri in self.cfg.lora_modules:
            for manager in self.loras.managers:
                reply = await manager.load(name, uri)
                if reply.status != "success":
                    log.error("--lora-modules %s=%s: %s", name, uri, reply.message)
                    self.exit_code = EXIT_BAD_CONFIG
                    return False
        return True

    def _engine_died(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        reason = task.result() if exc is None else f"{type(exc).__name__}: {exc}"
        log.error("engine is dead (%s); unregistering and exiting", reason)
        self.exit_code = EXIT_ENGINE_DEAD
        self.stopping.set()


def event_loop_runner() -> Callable[[Awaitable[int]], int]:
    """uvloop, as `vllm serve`'s uvicorn runs it: a worker's loop carries every request in and every token
    out (the simulated fleet's loop is most of its work). asyncio in checkpoint mode: uvloop's libuv (1.52)
    maps io_uring rings whatever UV_USE_IO_URING says, and CRIU cannot dump io_uring ("Unknown shit 600
    (anon_inode:[io_uring])")."""
    return asyncio.run if os.environ.get(SNAPSHOT_CONTROL_DIR_ENV) else uvloop.run


def run_host(main: Callable[[], Awaitable[int]]) -> int:
    """Run a worker process's `main` coroutine on `event_loop_runner()`; its exit status (a config the event
    plane cannot use exits like a bad flag)."""
    try:
        return event_loop_runner()(main())
    except EventPlaneError as exc:
        log.error("%s", exc)
        return EXIT_BAD_CONFIG

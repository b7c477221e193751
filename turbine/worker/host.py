"""The worker host: the one sequence every worker-kind process runs around its engine(s).

Start: signal handling, status server, event plane, the engine's instances (built by the
engine kind), their request-plane servers, then registration (instance records, then the
model card: only then is an instance routed to) and readiness (a canary proves the engine).
While serving: the engine's death ends the process (EXIT_ENGINE_DEAD).
Stop (SIGTERM/SIGINT or engine death): not ready, unregister first so no new traffic comes,
let in-flight requests finish within the grace period (none after engine death), close all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from turbine.config import make_registry
from turbine.protocol.discovery import ModelCard
from turbine.runtime import cluster_auth
from turbine.runtime.event_plane import EventPlaneError, WorkerEventPlane
from turbine.runtime.lifecycle import drain_and_stop, stop_on_signals
from turbine.runtime.registration import advertised_address, register, unregister
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.status_server import Health, make_app, serve_status
from turbine.worker.config import ServingConfig

log = logging.getLogger("turbine.worker")

EXIT_BAD_CONFIG = 2  # as argparse: a flag names something unusable (e.g. --nats-server)
EXIT_ENGINE_DEAD = 3


@dataclass
class Instance:
    """One served instance: its request-plane server (endpoints registered, not started yet)
    and its model card."""

    server: RequestPlaneServer
    card: ModelCard


class EngineKind(Protocol):
    """What an engine kind (vLLM, the mocker) gives the host."""

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

    async def run(self) -> int:
        cfg, engine, health = self.cfg, self.engine, self.health
        cluster_auth.install(cfg.security.auth())  # before any plane opens
        stop_on_signals(self.stopping)
        status_server = None
        if cfg.system_port is not None:
            status_server = await serve_status(make_app(health, engine.refresh_gauges), cfg.system_host,
                                               cfg.system_port)
            log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)
        plane = None
        registry = None
        try:
            # Before the engine: an unreachable NATS server fails the start at once.
            plane = await WorkerEventPlane.open(cfg.event_plane, cfg.host, cfg.nats_server)
            instances = await engine.start(plane, health)
            servers = [i.server for i in instances]
            for server in servers:
                await server.start()
            registry = make_registry(cfg.discovery)
            await registry.backend.start()
            records = []
            for instance in instances:
                records += await register(registry, instance.card, advertised_address(instance.server.address))
            health.set_ready(engine.canary, failure=engine.failure)
            monitor = asyncio.create_task(engine.died())
            monitor.add_done_callback(self._engine_died)
            engine.serving()
            await self.stopping.wait()
            monitor.remove_done_callback(self._engine_died)
            monitor.cancel()
            health.set_not_ready()
            # Unregister first so no new traffic arrives, then let in-flight requests finish.
            await unregister(registry, records)
            await drain_and_stop(servers, cfg.graceful_shutdown_timeout if self.exit_code == 0 else 0)
        finally:
            if registry is not None:
                await registry.backend.close()
            if status_server is not None:
                status_server.should_exit = True
            await engine.close()
            if plane is not None:
                await plane.close()
        return self.exit_code

    def _engine_died(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        reason = task.result() if exc is None else f"{type(exc).__name__}: {exc}"
        log.error("engine is dead (%s); unregistering and exiting", reason)
        self.exit_code = EXIT_ENGINE_DEAD
        self.stopping.set()


def run_host(main: Callable[[], Awaitable[int]], runner: Callable[[Awaitable[int]], int] = asyncio.run) -> int:
    """Run a worker process's `main` coroutine; its exit status (a config the event plane cannot
    use exits like a bad flag)."""
    try:
        return runner(main())
    except EventPlaneError as exc:
        log.error("%s", exc)
        return EXIT_BAD_CONFIG

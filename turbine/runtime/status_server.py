"""A worker's status HTTP server: /live, /health (proved by a canary request), /metrics, and
whatever routes the process adds (a worker's /engine/sleep, /engine/wake_up, /engine/is_sleeping)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

# A real request that finished this recently proves the engine works; skip the canary.
RECENT_SUCCESS_S = 10.0

Canary = Callable[[], Awaitable[str | None]]  # runs a tiny request; None = healthy, else why not


class Health:
    """What /health reports. Ready means the engine is up AND its model card is registered."""

    def __init__(self):
        self.last_success = 0.0
        self._canary: Canary | None = None
        self._failure: Callable[[], str | None] = lambda: None
        self.sleeping = False  # every engine of the process is asleep: not ready, no canary

    @property
    def ready(self) -> bool:
        return self._canary is not None

    def set_ready(self, canary: Canary, failure: Callable[[], str | None] | None = None) -> None:
        """`failure()` is checked on every probe (e.g. a dead engine), whatever the canary says."""
        self._canary = canary
        if failure is not None:
            self._failure = failure

    def set_not_ready(self) -> None:
        self._canary = None

    def succeeded(self) -> None:
        """A request completed: the engine works, so probes need no canary for a while. The
        handlers call it (rather than a wrapper around every stream: one async-generator layer
        less per token)."""
        self.last_success = time.monotonic()

    async def check(self) -> tuple[str, str | None]:
        """(status, reason): status is "starting", "sleeping", "unhealthy" or "healthy"."""
        canary = self._canary
        if canary is None:
            return "starting", None
        if self.sleeping:
            return "sleeping", None
        if reason := self._failure():
            return "unhealthy", reason
        if time.monotonic() - self.last_success > RECENT_SUCCESS_S:
            if reason := await canary():
                return "unhealthy", reason
            self.last_success = time.monotonic()
        return "healthy", None


def make_app(health: Health, metrics_hook: Callable[[], None] | None = None,
             routes: Sequence[BaseRoute] = ()) -> Starlette:
    async def live(_: Request):
        return JSONResponse({"status": "live"})

    async def healthz(_: Request):
        status, reason = await health.check()
        body = {"status": status} if reason is None else {"status": status, "reason": reason}
        return JSONResponse(body, status_code=200 if status == "healthy" else 503)

    async def metrics(_: Request):
        if metrics_hook:
            metrics_hook()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/live", live), Route("/health", healthz), Route("/metrics", metrics), *routes])


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the worker owns SIGTERM/SIGINT


async def serve_status(app: Starlette, host: str, port: int) -> uvicorn.Server:
    server = _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    return server

"""The worker's status HTTP server: /live, /health (with a one-token canary), /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = logging.getLogger("turbine.vllm")

CANARY_TIMEOUT_S = 10.0
# A real request that finished this recently proves the engine works; skip the canary.
RECENT_SUCCESS_S = 10.0


class WorkerStatus:
    """What /health reports. `ready` means the engine is up AND the model card is registered."""

    def __init__(self):
        self.ready = False
        self.last_success = 0.0
        self.engine = None

    async def canary(self) -> str | None:
        """Generate one token; return None when healthy, else the reason."""
        from vllm import SamplingParams

        request_id = f"canary-{uuid.uuid4().hex[:8]}"
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            async with asyncio.timeout(CANARY_TIMEOUT_S):
                async for _ in self.engine.generate({"prompt_token_ids": [1]}, params, request_id):
                    pass
        except TimeoutError:
            await self.engine.abort(request_id)
            return f"canary generate did not finish in {CANARY_TIMEOUT_S:.0f}s"
        except Exception as exc:
            return f"canary generate failed: {type(exc).__name__}: {exc}"
        self.last_success = time.monotonic()
        return None


def make_app(status: WorkerStatus, metrics_hook=None) -> Starlette:
    async def live(_: Request):
        return JSONResponse({"status": "live"})

    async def health(_: Request):
        if not status.ready or status.engine is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if status.engine.errored:
            return JSONResponse({"status": "unhealthy", "reason": "engine is dead"}, status_code=503)
        if time.monotonic() - status.last_success > RECENT_SUCCESS_S:
            reason = await status.canary()
            if reason:
                return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "healthy"})

    async def metrics(_: Request):
        if metrics_hook:
            metrics_hook()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/live", live), Route("/health", health), Route("/metrics", metrics)])


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

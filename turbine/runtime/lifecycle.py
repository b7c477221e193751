"""Process lifecycle of a worker: SIGTERM/SIGINT ask it to stop; stopping lets in-flight
requests finish within a grace period before the request-plane servers close. Requests still
running then end with the typed `shutting_down` error, which the frontend migrates."""

from __future__ import annotations

import asyncio
import logging
import signal

from turbine.protocol import errors as codes
from turbine.protocol.errors import WorkerError
from turbine.runtime.request_plane import RequestPlaneServer

log = logging.getLogger("turbine.lifecycle")


def stop_on_signals(stopping: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)


async def drain_and_stop(servers: list[RequestPlaneServer], grace_s: float) -> None:
    """Wait up to `grace_s` for open streams to finish (call after unregistering, so no new
    ones arrive), then stop every server: streams still open end with `shutting_down`."""
    inflight = sum(s.inflight for s in servers)
    if grace_s > 0 and inflight:
        log.info("waiting up to %.0fs for %d in-flight requests", grace_s, inflight)
        await asyncio.gather(*(s.drain(grace_s) for s in servers))
    left = sum(s.inflight for s in servers)
    if left:
        log.info("%d requests still running: ending them with %s (the frontend may migrate them)", left,
                 codes.SHUTTING_DOWN)
    error = WorkerError.of(codes.SHUTTING_DOWN, "the worker is shutting down (its grace period is over)")
    await asyncio.gather(*(s.stop(error) for s in servers))

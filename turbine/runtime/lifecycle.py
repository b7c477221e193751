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


# After unregistering, how long a worker keeps serving even when idle: a frontend that has not
# seen the change yet (file discovery polls every 0.25 s) may still send it a request, on a
# connection it already has; closing that connection under it would fail the request unless
# the frontend migrates. Bounded by the grace period.
UNREGISTER_SETTLE_S = 1.0


async def drain_and_stop(servers: list[RequestPlaneServer], grace_s: float, settle_s: float = 0.0) -> None:
    """Wait up to `grace_s` for open streams to finish (call after unregistering, so no new
    ones arrive; those sent in the first `settle_s` seconds by routers that had not seen it
    yet are served too), then stop every server: streams still open end with `shutting_down`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if grace_s > 0 and settle_s > 0:
        await asyncio.sleep(min(settle_s, grace_s))
    grace_s = max(0.0, deadline - loop.time())
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

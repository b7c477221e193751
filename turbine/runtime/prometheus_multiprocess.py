"""Prometheus metrics that add up across the processes behind one scrape (prometheus_client's
multiprocess mode), for a parent that starts several processes serving one port (the frontend's
--frontend-processes N).

Each process writes its metrics' values to memory-mapped files in one directory
(PROMETHEUS_MULTIPROC_DIR, which must be in the environment before prometheus_client is imported:
the parent sets it, then starts its children); whichever process answers a scrape reads every
file, so counters and histograms are the sum over the processes, and a gauge is combined by the
mode it was declared with (`multiprocess_mode`: "livesum" for what each process holds, such as its
requests in flight; "livemostrecent" for what every process sees alike, such as a worker's reported
load; without one a gauge would be repeated once per process with a `pid` label). The parent marks
a child that ended dead (its live gauges leave the sum) and removes a directory it created.

Why prometheus_client's own mode: it is the library's documented way (Gunicorn, vLLM's API servers
use it too), and a hand-made aggregator would have to re-implement its files and gauge modes.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile

from prometheus_client import CollectorRegistry, generate_latest

log = logging.getLogger("turbine.metrics")

ENV = "PROMETHEUS_MULTIPROC_DIR"


def enabled() -> bool:
    """Whether this process's metrics are in multiprocess mode (the directory was set before it started)."""
    return bool(os.environ.get(ENV))


class MultiprocessDir:
    """The parent's side: the directory its children write to, made ready before they start."""

    def __init__(self):
        given = os.environ.get(ENV)
        self.owned = not given
        if given:
            os.makedirs(given, exist_ok=True)
            stale = glob.glob(os.path.join(given, "*.db"))
            for path in stale:  # a previous run's values would be added to this one's
                os.remove(path)
            if stale:
                log.info("%s=%s: removed %d metric file(s) of an earlier run", ENV, given, len(stale))
            self.path = given
        else:
            self.path = tempfile.mkdtemp(prefix="turbine-prometheus-")
            os.environ[ENV] = self.path  # the children inherit it

    def process_ended(self, pid: int) -> None:
        """A child ended: its live gauges no longer count."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.path)

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
            if os.environ.get(ENV) == self.path:
                del os.environ[ENV]


class Exposition:
    """A process's /metrics text: its own registry, or in multiprocess mode every process's metrics."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        if enabled():
            from prometheus_client import multiprocess

            self._registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._registry)

    def text(self) -> bytes:
        return generate_latest(self._registry)

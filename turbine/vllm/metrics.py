"""Worker-side Prometheus metrics. vLLM registers its own `vllm:*` metrics in the same
default registry, so one /metrics page shows both."""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class WorkerMetrics:
    def __init__(self, labels: dict[str, str]):
        names, self._values = list(labels), list(labels.values())
        self._requests = Counter("turbine_worker_requests", "generate requests by outcome",
                                 names + ["outcome"])
        self._errors = Counter("turbine_worker_errors", "generate errors by type", names + ["error_type"])
        self.cancellations = Counter("turbine_worker_cancellations",
                                     "generate requests aborted before they finished", names).labels(*self._values)
        self.inflight = Gauge("turbine_worker_inflight_requests", "generate requests in flight",
                              names).labels(*self._values)
        self.engine_unfinished = Gauge("turbine_worker_engine_unfinished_requests",
                                       "requests the vLLM engine still holds", names).labels(*self._values)
        self.total_kv_blocks = Gauge("turbine_worker_total_kv_blocks", "KV cache blocks",
                                     names).labels(*self._values)

    def request_done(self, outcome: str) -> None:
        self._requests.labels(*self._values, outcome).inc()

    def error(self, error_type: str) -> None:
        self._errors.labels(*self._values, error_type).inc()

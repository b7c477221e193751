"""Frontend Prometheus metrics (own registry, so tests and embedding stay isolated). With
--frontend-processes N they add up across the processes (turbine/runtime/prometheus_multiprocess.py):
every gauge here declares how it combines."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from turbine.router.metrics import RouterMetrics
from turbine.runtime.prometheus_multiprocess import Exposition

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Tokens per request: powers of two up to 128k (a planner reads _sum / _count for the mean).
_SEQUENCE_BUCKETS = tuple(float(2 ** k) for k in range(0, 18))


class FrontendMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("turbine_frontend_requests", "HTTP requests by model, endpoint and status",
                                ["model", "endpoint", "status"], registry=r)
        self.inflight = Gauge("turbine_frontend_inflight_requests", "requests being served", ["model"], registry=r,
                              multiprocess_mode="livesum")
        self.ttft = Histogram("turbine_frontend_time_to_first_token_seconds", "time to first token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("turbine_frontend_inter_token_latency_seconds", "time between output tokens",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("turbine_frontend_request_duration_seconds", "whole request",
                                  ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Counter("turbine_frontend_input_tokens", "prompt tokens", ["model"], registry=r)
        self.output_tokens = Counter("turbine_frontend_output_tokens", "generated tokens", ["model"], registry=r)
        self.cached_tokens = Counter("turbine_frontend_cached_tokens", "prompt tokens served from KV cache",
                                     ["model"], registry=r)
        # Per finished request (the counters above count tokens, not requests): the planner's
        # request rate, mean ISL and OSL per interval come from these histograms' _count and _sum.
        self.input_sequence = Histogram("turbine_frontend_input_sequence_tokens",
                                        "prompt tokens of each finished request", ["model"],
                                        buckets=_SEQUENCE_BUCKETS, registry=r)
        self.output_sequence = Histogram("turbine_frontend_output_sequence_tokens",
                                         "generated tokens of each finished request", ["model"],
                                         buckets=_SEQUENCE_BUCKETS, registry=r)
        self.router = RouterMetrics(r)  # the kv routers' metrics, in this registry
        # The response store (stored responses, conversations): each operation's time, by op.
        self.response_store = Histogram("turbine_frontend_response_store_seconds",
                                        "response store operations (get, put, create, update, delete)", ["op"],
                                        buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                        registry=r)
        self.disconnects = Counter("turbine_frontend_disconnected_clients", "clients gone before the end",
                                   ["model"], registry=r)
        self.prefills = Counter("turbine_frontend_prefills",
                                "prompts prefilled by where: remote (a prefill worker, KV handed to decode) "
                                "or local_fallback (prefill workers failed; the decode worker computed it)",
                                ["model", "where"], registry=r)
        self.disagg_lora_fallback = Counter("turbine_frontend_disagg_lora_fallback",
                                            "requests for a LoRA adapter of a disaggregated model served "
                                            "aggregated (prefilled on the decode worker): no prefill worker "
                                            "holds the adapter", ["model"], registry=r)
        self.migrations = Counter("turbine_frontend_migrations",
                                  "requests moved to another worker after theirs failed, by reason: disconnected "
                                  "(the worker vanished) or the worker's error code (shutting_down, overloaded ...)",
                                  ["model", "reason"], registry=r)
        self.migration_limit_exceeded = Counter("turbine_frontend_migration_limit_exceeded",
                                                "worker failures not migrated because the request had used up "
                                                "its migration limit", ["model"], registry=r)
        # Overload control: refusals by workers (each tried on another worker), requests answered
        # 503 because every worker refused, and requests refused at the frontend's own bound.
        self.worker_overloaded = Counter("turbine_frontend_worker_overloaded_refusals",
                                         "workers' 'overloaded' refusals (the request went to another worker)",
                                         ["model"], registry=r)
        self.overloaded = Counter("turbine_frontend_overloaded_rejections",
                                  "requests answered 503 'overloaded': every worker refused them", ["model"], registry=r)
        self.inflight_limit = Counter("turbine_frontend_inflight_limit_rejections",
                                      "requests answered 503 'overloaded' at --max-inflight-requests", registry=r)
        # Busy thresholds (busy_queue.py): requests waiting for a worker below them, their waits
        # (0 for a request that did not wait), and those refused because the queue was full.
        self.queued = Gauge("turbine_frontend_queued_requests",
                            "requests waiting at the frontend for a worker below the busy thresholds",
                            ["model"], registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram("turbine_frontend_queue_wait_seconds",
                                    "time a request waited for a worker below the busy thresholds",
                                    ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_full = Counter("turbine_frontend_queue_full_rejections",
                                  "requests answered 503 'overloaded' because --busy-queue-size requests waited",
                                  ["model"], registry=r)
        # Requests for a model whose every worker sleeps (503 model_asleep): the demand a planner with a
        # sleeping pool wakes a worker for (turbine/planner/service.py).
        self.asleep = Counter("turbine_frontend_model_asleep_rejections",
                              "requests answered 503 'model_asleep': every worker of the model sleeps", ["model"],
                              registry=r)
        # The global router (--pool, pools.py): requests routed to each pool, and each pool's live workers.
        self.pool_requests = Counter("turbine_frontend_pool_requests", "requests routed to each pool (--pool)",
                                     ["model", "pool"], registry=r)
        self.pool_workers = Gauge("turbine_frontend_pool_workers", "live workers of the model in each pool (--pool)",
                                  ["model", "pool"], registry=r, multiprocess_mode="livemostrecent")
        self._models: dict[str, ModelMetrics] = {}
        self.exposition = Exposition(r)  # the /metrics text: this registry, or every frontend process's

    def of(self, model: str) -> ModelMetrics:
        """The model's bound metrics (made on first use)."""
        bound = self._models.get(model)
        if bound is None:
            bound = self._models[model] = ModelMetrics(self, model)
        return bound


class ModelMetrics:
    """One model's label children, bound once: `labels()` is a dict lookup under a lock, too
    much to pay per streamed token."""

    def __init__(self, m: FrontendMetrics, model: str):
        self.inflight = m.inflight.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.duration = m.duration.labels(model)
        self.input_tokens = m.input_tokens.labels(model)
        self.output_tokens = m.output_tokens.labels(model)
        self.cached_tokens = m.cached_tokens.labels(model)
        self.input_sequence = m.input_sequence.labels(model)
        self.output_sequence = m.output_sequence.labels(model)
        self.disconnects = m.disconnects.labels(model)
        self.remote_prefills = m.prefills.labels(model, "remote")
        self.local_prefills = m.prefills.labels(model, "local_fallback")
        self.disagg_lora_fallback = m.disagg_lora_fallback.labels(model)
        self.migration_limit_exceeded = m.migration_limit_exceeded.labels(model)
        self._migrations = m.migrations
        self._model = model
        self.worker_overloaded = m.worker_overloaded.labels(model)
        self.overloaded = m.overloaded.labels(model)
        self.queued = m.queued.labels(model)
        self.queue_wait = m.queue_wait.labels(model)
        self.queue_full = m.queue_full.labels(model)

    def migrations(self, reason: str):
        """The migrations counter of one reason (rare: looked up when it happens)."""
        return self._migrations.labels(self._model, reason)


def observe_many(histogram, amounts: list[float]) -> None:
    """`histogram.observe(a)` for every amount, with one increment per bucket touched. A request's
    inter-token gaps (hundreds) are observed when it ends; one `observe` each (a lock and a walk of the
    buckets per value: about 1 ms per request on the H200 host, 0.68 ms for 511 gaps on a 2-core CPU host) made a wave of 256 requests ending together hold the
    frontend's event loop for ~0.3 s, while the next wave waited to be sent to the engine (py-spy and the
    engine's running requests on an H200, 2026-12-01: docs/benchmarks/gpu.md). prometheus_client has no bulk
    observe, so this adds to the child's sum and bucket values as its `observe` does (`_sum`, `_buckets`,
    `_upper_bounds`; tests/unit/frontend/test_metrics.py compares the two on every boundary)."""
    if not amounts:
        return
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds  # ascending, the last +Inf: `observe` counts a value in the first bound >= it
    counts = [0] * len(bounds)
    for amount in amounts:
        counts[bisect_left(bounds, amount)] += 1
    histogram._sum.inc(sum(amounts))
    for bucket, n in zip(histogram._buckets, counts):
        if n:
            bucket.inc(n)

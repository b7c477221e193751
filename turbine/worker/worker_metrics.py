"""Prometheus metrics that every worker-kind process exports, one labelled series per served
instance (a mocker process serves many). Families are created once per process: names in
prometheus_client's default registry are global. vLLM registers its own `vllm:*` metrics
in the same registry, so one /metrics page shows both."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LABELS = ("namespace", "component", "model", "worker_id")

_requests = Counter("turbine_worker_requests", "generate requests by outcome", [*LABELS, "outcome"])
_errors = Counter("turbine_worker_errors", "generate errors by type", [*LABELS, "error_type"])
_cancellations = Counter("turbine_worker_cancellations", "generate requests aborted before they finished",
                         LABELS)
_inflight = Gauge("turbine_worker_inflight_requests", "generate requests in flight", LABELS)
_engine_unfinished = Gauge("turbine_worker_engine_unfinished_requests", "requests the engine still holds",
                           LABELS)
# Per data-parallel rank: each rank's engine has its own KV cache.
_RANKED = (*LABELS, "dp_rank")
_total_kv_blocks = Gauge("turbine_worker_total_kv_blocks", "KV cache blocks of each data-parallel rank's engine "
                         "(0 while it sleeps)", _RANKED)
_active_kv_blocks = Gauge("turbine_worker_active_kv_blocks",
                          "KV cache blocks held by requests (cached blocks free for reuse not counted), "
                          "as of the engine's last step", _RANKED)
_kv_cache_usage = Gauge("turbine_worker_kv_cache_usage_perc",
                        "share of the KV cache held by requests, 0 to 1, as of the engine's last step: the vLLM "
                        "worker's is vLLM's own vllm:kv_cache_usage_perc (a fraction despite its name), the "
                        "mocker's its blocks in use over its blocks", _RANKED)
_model_load_seconds = Gauge("turbine_worker_model_load_seconds",
                            "seconds the last engine build took (weights loaded, KV cache allocated), or the last "
                            "wake from a level-2 sleep (weights loaded again)", LABELS)
_overload_rejections = Counter("turbine_worker_overload_rejections",
                               "requests refused as overloaded, by the bound they hit "
                               "(waiting_requests or queued_prefill_tokens)", [*LABELS, "bound"])
_waiting_requests = Gauge("turbine_worker_waiting_requests",
                          "requests accepted that have no first output yet (the queue overload control bounds)",
                          LABELS)
_queued_prefill_tokens = Gauge("turbine_worker_queued_prefill_tokens",
                               "prompt tokens of the waiting requests still to compute", LABELS)
_lora_engine_loads = Counter("turbine_worker_lora_engine_loads",
                            "LoRA adapters handed to the engine to load (a load of a name already loaded is "
                            "answered without the engine)", LABELS)
_loras_loaded = Gauge("turbine_worker_loras_loaded", "LoRA adapters loaded", LABELS)
# The omni worker's pipeline stages (vLLM-Omni's own per-stage generation time of each finished request).
_omni_stage_seconds = Histogram("turbine_worker_omni_stage_seconds",
                                "seconds each stage of an omni pipeline spent generating a finished request, by "
                                "stage id (vLLM-Omni's stage generation time)", [*LABELS, "stage"],
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60))
_images = Counter("turbine_worker_images", "images received, by form: file (the worker decodes it) or pixels "
                  "(decoded by the frontend: its --frontend-decoding)", [*LABELS, "form"])


class RankGauges:
    """One data-parallel rank's KV gauges."""

    def __init__(self, values: list[str], rank: int):
        self.total_kv_blocks = _total_kv_blocks.labels(*values, str(rank))
        self.active_kv_blocks = _active_kv_blocks.labels(*values, str(rank))
        self.kv_cache_usage = _kv_cache_usage.labels(*values, str(rank))


class WorkerMetrics:
    """The series of one instance; `labels` has exactly the keys of LABELS; `data_parallel_size`: its
    engines (ranks), each with its own KV gauges (`ranks[i]`)."""

    def __init__(self, labels: dict[str, str], data_parallel_size: int = 1):
        self._values = [labels[name] for name in LABELS]
        self.cancellations = _cancellations.labels(*self._values)
        self.inflight = _inflight.labels(*self._values)
        self.engine_unfinished = _engine_unfinished.labels(*self._values)
        self.ranks = [RankGauges(self._values, rank) for rank in range(data_parallel_size)]
        self.model_load_seconds = _model_load_seconds.labels(*self._values)
        self.waiting_requests = _waiting_requests.labels(*self._values)
        self.queued_prefill_tokens = _queued_prefill_tokens.labels(*self._values)
        self.lora_engine_loads = _lora_engine_loads.labels(*self._values)
        self.loras_loaded = _loras_loaded.labels(*self._values)

    def set_total_kv_blocks(self, blocks: int) -> None:
        """Every rank's (they are built alike; 0 while the engines sleep)."""
        for rank in self.ranks:
            rank.total_kv_blocks.set(blocks)

    def request_done(self, outcome: str) -> None:
        _requests.labels(*self._values, outcome).inc()

    def omni_stage(self, stage: str, seconds: float) -> None:
        _omni_stage_seconds.labels(*self._values, stage).observe(seconds)

    def images(self, form: str, count: int) -> None:
        _images.labels(*self._values, form).inc(count)

    def error(self, error_type: str) -> None:
        _errors.labels(*self._values, error_type).inc()

    def overload_rejection(self, bound: str) -> None:
        _overload_rejections.labels(*self._values, bound).inc()

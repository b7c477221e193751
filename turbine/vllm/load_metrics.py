"""The vLLM worker's load metrics, taken from vLLM's stat-logger hook.

vLLM hands every custom stat logger the scheduler's stats after each engine step, on the
worker's event loop. Passing our logger in `stat_loggers` keeps vLLM's own loggers (the
periodic log line and the Prometheus `vllm:*` metrics): in vLLM 0.32 the StatLoggerManager
appends its defaults to the custom ones unless stats are disabled (--disable-log-stats, in
which case only custom loggers and Prometheus run).
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from turbine.worker.load_publisher import LoadMetricsPublisher
from turbine.worker.lora_slots import LoraSlots


class LoadMetricsStatLogger(StatLoggerBase):
    """One per engine (data-parallel rank): turns SchedulerStats into LoadMetrics updates."""

    def __init__(self, vllm_config, engine_index: int = 0, publisher: LoadMetricsPublisher | None = None,
                 rank_gauges=None):
        self.vllm_config = vllm_config
        self.engine_index = engine_index  # the data-parallel rank
        self.publisher = publisher
        self.gauges = rank_gauges  # this rank's KV gauges on the worker's /metrics (worker_metrics.RankGauges)
        # vLLM keeps the active adapters in an LRU of max_loras GPU slots inside the engine core
        # (its model runner's LRUCacheWorkerLoRAManager), in another process, and its stats do not
        # carry the slots. What the stats carry is the adapters of the running requests
        # (running_lora_adapters); each of those is in a slot. So the worker keeps an LRU of the
        # same capacity over them: the adapters it reports active are the ones most recently run.
        # (vLLM fills running_lora_adapters only while it logs stats: with --disable-log-stats the
        # report names no adapters and routers see every worker's slots as empty.)
        lora_config = getattr(vllm_config, "lora_config", None)
        self.lora_slots = LoraSlots(lora_config.max_loras) if lora_config is not None else None

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        # Read here, not at construction: the engine sizes its cache after the loggers exist.
        total = self.vllm_config.cache_config.num_gpu_blocks or 0
        usable = max(total - 1, 0)  # vLLM's usage leaves out its null block
        active = round(scheduler_stats.kv_cache_usage * usable)
        if self.gauges is not None:
            self.gauges.active_kv_blocks.set(active)
            self.gauges.kv_cache_usage.set(scheduler_stats.kv_cache_usage)  # what vLLM's own gauge shows
        slots = self.lora_slots
        if slots is not None:
            running = [name for name, n in (scheduler_stats.running_lora_adapters or {}).items() if n > 0]
            slots.touch(running[-slots.capacity:] if slots.capacity else ())
        if self.publisher is None:
            return
        self.publisher.update(
            self.engine_index,
            kv_active_blocks=active,
            kv_total_blocks=total,
            num_running=scheduler_stats.num_running_reqs,
            num_waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
            max_loras=slots.capacity if slots is not None else 0,
            active_loras=slots.resident if slots is not None else (),
        )

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(publisher: LoadMetricsPublisher | None, rank_gauges=None):
    """What `AsyncLLM.from_engine_args(stat_loggers=[...])` takes: (vllm_config, engine_index) -> logger.
    `rank_gauges`: the worker's KV gauges of each data-parallel rank (WorkerMetrics.ranks)."""
    def make(vllm_config, engine_index: int = 0) -> LoadMetricsStatLogger:
        gauges = rank_gauges[engine_index] if rank_gauges is not None and engine_index < len(rank_gauges) else None
        return LoadMetricsStatLogger(vllm_config, engine_index, publisher, gauges)

    return make

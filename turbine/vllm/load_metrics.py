"""The vLLM worker's load metrics, taken from vLLM's stat-logger hook.

vLLM hands every custom stat logger the scheduler's stats after each engine step, on the
worker's event loop. Passing our logger in `stat_loggers` keeps vLLM's own loggers (the
periodic log line and the Prometheus `vllm:*` metrics): in vLLM 0.32 the StatLoggerManager
appends its defaults to the custom ones unless stats are disabled (--disable-log-stats, in
which case only custom loggers and Prometheus run).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.metrics.loggers import StatLoggerBase

from turbine.worker.load_publisher import LoadMetricsPublisher
from turbine.worker.lora_slots import LoraSlots


@dataclass
class StatTargets:
    """Where the engine's stat loggers report: read at every report, so that they can be set after the
    engine is built (checkpoint mode: once a restored worker knows its identity). None: dropped until set.
    `rank_gauges`: the worker's KV gauges of each data-parallel rank (WorkerMetrics.ranks)."""

    publisher: LoadMetricsPublisher | None = None
    rank_gauges: list | None = None
    pulls_kv: bool = False  # a decode worker's engine: its prompts' KV arrives from prefill workers


class LoadMetricsStatLogger(StatLoggerBase):
    """One per engine (data-parallel rank): turns SchedulerStats into LoadMetrics updates."""

    def __init__(self, vllm_config, engine_index: int = 0, publisher: LoadMetricsPublisher | None = None,
                 targets: StatTargets | None = None):
        self.vllm_config = vllm_config
        self.engine_index = engine_index  # the data-parallel rank
        self.targets = targets if targets is not None else StatTargets(publisher)
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
        ranks = self.targets.rank_gauges
        if ranks is not None and self.engine_index < len(ranks):  # this rank's KV gauges on the worker's /metrics
            ranks[self.engine_index].active_kv_blocks.set(active)
            ranks[self.engine_index].kv_cache_usage.set(scheduler_stats.kv_cache_usage)  # as vLLM's own gauge
        slots = self.lora_slots
        if slots is not None:
            running = [name for name, n in (scheduler_stats.running_lora_adapters or {}).items() if n > 0]
            slots.touch(running[-slots.capacity:] if slots.capacity else ())
        if self.targets.publisher is None:
            return
        self.targets.publisher.update(
            self.engine_index,
            kv_active_blocks=active,
            kv_total_blocks=total,
            num_running=scheduler_stats.num_running_reqs,
            num_waiting=queued_for_admission(scheduler_stats, self.targets.pulls_kv),
            max_loras=slots.capacity if slots is not None else 0,
            active_loras=slots.resident if slots is not None else (),
        )

    def log_engine_initialized(self) -> None:
        pass


# vLLM's stages of a request whose KV arrives from elsewhere (vllm.v1.metrics.stats.KV_FETCH_STAGES, from
# 0.32). In these two the request holds its blocks and is not queued for admission: its KV is in transit
# or has landed. In the third, waiting to start, it has no blocks yet and queues like any other.
KV_FETCH_HOLDING_STAGES = ("in_progress", "completed_waiting")


def queued_for_admission(stats, pulls_kv: bool) -> int:
    """vLLM's waiting requests less those holding blocks while their KV arrives. A decode worker of a
    disaggregated pair pulls every prompt's KV, so counting those would read as a queue of decode work
    (the planner scales decode up on any waiting request) while decode has room."""
    fetching = getattr(stats, "num_kv_fetch_reqs_by_stage", None)
    if fetching is None:
        # Releases before the stages (the GPU's 0.26) park a request whose KV is in transit in their
        # skipped-waiting queue, with those waiting for a LoRA slot or a grammar; a decode worker's are
        # nearly all KV pulls.
        return stats.num_waiting_reqs + (0 if pulls_kv else stats.num_skipped_waiting_reqs)
    holding = sum(fetching.get(stage, 0) for stage in KV_FETCH_HOLDING_STAGES)
    return max(0, stats.num_waiting_reqs + stats.num_skipped_waiting_reqs - holding)


def stat_logger_factory(targets: StatTargets):
    """What `AsyncLLM.from_engine_args(stat_loggers=[...])` takes: (vllm_config, engine_index) -> logger."""
    def make(vllm_config, engine_index: int = 0) -> LoadMetricsStatLogger:
        return LoadMetricsStatLogger(vllm_config, engine_index, targets=targets)

    return make

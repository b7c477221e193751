"""The vLLM worker's load report names the adapters in the engine's active slots. vLLM keeps the
slots in its engine core (another process); its stats carry the running requests' adapters, and
the worker keeps an LRU of max_loras over those."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import LoRAConfig
from vllm.v1.metrics.stats import SchedulerStats

from turbine.vllm.load_metrics import LoadMetricsStatLogger
from turbine.worker.load_publisher import LoadMetricsPublisher


class Plane:
    """The event plane's publish (what the publisher writes to); records the reports."""

    def __init__(self):
        self.sent = []

    def publish(self, topic, message):
        self.sent.append(message)


def stats(running_loras: dict[str, int]) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=sum(running_loras.values()), running_lora_adapters=running_loras)


def logger(lora_config):
    plane = Plane()
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=100), lora_config=lora_config)
    return LoadMetricsStatLogger(config, 0, LoadMetricsPublisher(plane, "w", min_interval_s=0, keepalive_s=0)), plane


async def test_running_adapters_fill_an_lru_of_max_loras():
    log, plane = logger(LoRAConfig(max_loras=2))
    log.record(stats({"a": 1, "b": 2}), None)
    assert plane.sent[-1].max_loras == 2 and plane.sent[-1].active_loras == ["a", "b"]
    log.record(stats({"b": 1}), None)  # a finished: it stays in its slot until another adapter needs one
    assert plane.sent[-1].active_loras == ["a", "b"]
    log.record(stats({"c": 1}), None)
    assert plane.sent[-1].active_loras == ["b", "c"]
    log.record(stats({"c": 0}), None)  # vLLM may list an adapter with no request left
    assert plane.sent[-1].active_loras == ["b", "c"]


async def test_without_lora_the_report_says_no_slots():
    log, plane = logger(None)
    log.record(stats({}), None)
    assert plane.sent[-1].max_loras == 0 and plane.sent[-1].active_loras == []

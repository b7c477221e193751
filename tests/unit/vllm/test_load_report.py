"""The vLLM worker's load report, made from vLLM's scheduler stats.

It names the adapters in the engine's active slots: vLLM keeps the slots in its engine core (another
process); its stats carry the running requests' adapters, and the worker keeps an LRU of max_loras
over those. Its waiting count leaves out requests that hold their blocks while their KV arrives."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import LoRAConfig
from vllm.v1.metrics.stats import SchedulerStats

from turbine.vllm.load_metrics import LoadMetricsStatLogger, StatTargets
from turbine.worker.load_publisher import LoadMetricsPublisher


class Plane:
    """The event plane's publish (what the publisher writes to); records the reports."""

    def __init__(self):
        self.sent = []

    def publish(self, topic, message):
        self.sent.append(message)


def stats(running_loras: dict[str, int]) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=sum(running_loras.values()), running_lora_adapters=running_loras)


def logger(lora_config, *, pulls_kv=False):
    plane = Plane()
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=100), lora_config=lora_config)
    publisher = LoadMetricsPublisher(plane, "w", min_interval_s=0, keepalive_s=0)
    return LoadMetricsStatLogger(config, 0, targets=StatTargets(publisher, pulls_kv=pulls_kv)), plane


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


async def test_requests_receiving_their_kv_are_not_waiting():
    log, plane = logger(None)
    # 2 queued, 1 deferred; of these, one waits to start its KV fetch (no blocks yet: it queues), one's
    # transfer is in flight and one's KV has landed (both hold their blocks).
    fetch = {"waiting_to_start": 1, "in_progress": 1, "completed_waiting": 1}
    log.record(SchedulerStats(num_waiting_reqs=2, num_skipped_waiting_reqs=1, num_kv_fetch_reqs_by_stage=fetch), None)
    assert plane.sent[-1].num_waiting == 1
    log.record(SchedulerStats(num_waiting_reqs=2, num_skipped_waiting_reqs=1, num_kv_fetch_reqs_by_stage={}), None)
    assert plane.sent[-1].num_waiting == 3  # no KV connector: no stages


async def test_before_vllms_fetch_stages_a_decode_worker_leaves_out_the_skipped_queue():
    # vLLM 0.26 (the GPU release) parks requests whose KV is in transit in its skipped-waiting queue and
    # counts no stages: a stats object without the field.
    old = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=2, num_skipped_waiting_reqs=3, kv_cache_usage=0.0,
                          running_lora_adapters={})
    decode, decode_plane = logger(None, pulls_kv=True)
    decode.record(old, None)
    assert decode_plane.sent[-1].num_waiting == 2
    agg, agg_plane = logger(None)  # an aggregated worker's skipped requests wait for a LoRA slot or a grammar
    agg.record(old, None)
    assert agg_plane.sent[-1].num_waiting == 5


def test_the_holding_stages_are_vllms():
    from vllm.v1.metrics import stats as vllm_stats
    from turbine.vllm.load_metrics import KV_FETCH_HOLDING_STAGES

    stages = getattr(vllm_stats, "KV_FETCH_STAGES", None)
    if stages is None:  # a release without the stages (the GPU's 0.26): nothing to leave out
        return
    assert set(KV_FETCH_HOLDING_STAGES) == {vllm_stats.KV_FETCH_IN_PROGRESS, vllm_stats.KV_FETCH_COMPLETED_WAITING}

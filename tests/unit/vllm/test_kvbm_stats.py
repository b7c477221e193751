"""The `turbine_kvbm_*` counts' trip from the model-runner process to the worker's /metrics, without an
engine: what the worker half sends per step (only what moved), how vLLM sums it, and what the worker
process's families show. (tests/integration/test_kvbm_vllm.py checks the same on a real engine.)"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from turbine.kvbm import Block, HostStore, TieredStore
from turbine.vllm import kvbm_stats
from turbine.vllm.kvbm_stats import KvbmPromMetrics, KvbmStats, StatsSource


def test_only_what_moved_is_sent_and_the_worker_process_shows_the_sums(monkeypatch):
    store = TieredStore([HostStore(10_000)])
    source = StatsSource(store.metrics)
    first = source.take()  # the tier's gauges as opened
    assert first is not None and first.data["counters"] == {}
    assert source.take() is None  # an idle step carries nothing

    store.put(Block(1, None, 4, b"x" * 100))
    store.get(1)
    store.get(2)
    step = source.take()
    counters = dict(step.data["counters"])
    assert counters.pop("turbine_kvbm_write_seconds")["host"] > 0
    assert counters.pop("turbine_kvbm_read_seconds")["host"] > 0
    assert counters == {"turbine_kvbm_blocks_stored": {"host": 1.0},
                                     "turbine_kvbm_bytes_written": {"host": 100.0},
                                     "turbine_kvbm_hits": {"host": 1.0}, "turbine_kvbm_bytes_read": {"host": 100.0},
                                     "turbine_kvbm_misses": {"": 1.0}}
    assert step.data["gauges"] == {"turbine_kvbm_tier_used_bytes": {"host": 100.0}}
    store.get(1)
    total = step.aggregate(source.take())
    assert total.data["counters"]["turbine_kvbm_hits"] == {"host": 2.0}
    assert total.reduce()["turbine_kvbm_hits[host]"] == 2.0 and not total.is_empty()
    assert KvbmStats().is_empty()

    registry = CollectorRegistry()
    monkeypatch.setattr(kvbm_stats, "_families", None)
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    prom = KvbmPromMetrics(_Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(total.to_dict(), 0)  # what vLLM's PrometheusStatLogger does with SchedulerStats' payload
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("turbine_kvbm_hits_total", {**labels, "tier": "host"}) == 2.0
    assert registry.get_sample_value("turbine_kvbm_misses_total", labels) == 1.0
    assert registry.get_sample_value("turbine_kvbm_tier_used_bytes", {**labels, "tier": "host"}) == 100.0


class _Config:
    kv_transfer_config = None

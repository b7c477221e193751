"""The tiers' `turbine_kvbm_*` metrics, carried from vLLM's model-runner process to the worker's /metrics.

The TieredStore (and so its KvbmMetrics registry) lives in the connector's worker half, in the
model-runner process; the worker's /metrics is served by the Turbine worker process. vLLM 0.32 has
a path between them for connector stats: after each step the model runner calls the worker half's
`get_kv_connector_stats()`; the engine core puts `to_dict()` of it into SchedulerStats (msgpack, plain
data), and in the Turbine worker process vLLM's PrometheusStatLogger hands it to the connector's
`build_prom_metrics()` object, which writes the default registry (served on /metrics). Stats only
flow while vLLM logs stats, which a Turbine worker always does (it passes its own stat logger).

Payload: {"counters": {family: {tier: increase since the last step}}, "gauges": {family: {tier: value}}}
("" for a family without a tier label); only what changed is sent, so idle steps carry nothing.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from turbine.kvbm.metrics import SPECS, KvbmMetrics

_SPEC_OF = {name: (kind, doc, labels) for _, kind, name, doc, labels in SPECS}


class KvbmStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges")

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = {f: dict(v) for f, v in self.data.get("counters", {}).items()}
        for f, by_tier in other.data.get("counters", {}).items():
            mine = counters.setdefault(f, {})
            for tier, n in by_tier.items():
                mine[tier] = mine.get(tier, 0.0) + n
        gauges = {f: dict(v) for f, v in self.data.get("gauges", {}).items()}
        for f, by_tier in other.data.get("gauges", {}).items():
            gauges.setdefault(f, {}).update(by_tier)  # the later value
        return KvbmStats({"counters": counters, "gauges": gauges})

    def reduce(self) -> dict[str, int | float]:
        """vLLM's periodic log line: the counters' increase over its interval."""
        return {f"{f}[{tier}]" if tier else f: n for f, by_tier in self.data.get("counters", {}).items()
                for tier, n in by_tier.items()}


class StatsSource:
    """The worker half's side: what its KvbmMetrics moved since the last call."""

    def __init__(self, metrics: KvbmMetrics):
        self.registry = metrics.registry
        self._sent: dict[tuple[str, str], float] = {}

    def take(self) -> KvbmStats | None:
        counters: dict[str, dict[str, float]] = {}
        gauges: dict[str, dict[str, float]] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if family.type == "counter" and not s.name.endswith("_total"):
                    continue  # the _created samples
                tier = next(iter(s.labels.values()), "")
                key = (family.name, tier)
                last = self._sent.get(key)
                if last == s.value:
                    continue
                self._sent[key] = s.value
                if family.type == "counter":
                    if s.value != (last or 0.0):  # an unlabelled counter starts with a 0 sample
                        counters.setdefault(family.name, {})[tier] = s.value - (last or 0.0)
                else:
                    gauges.setdefault(family.name, {})[tier] = s.value
        if not counters and not gauges:
            return None
        return KvbmStats({"counters": counters, "gauges": gauges})


_families: dict[str, Any] | None = None


def _create_families(metric_types: dict, labelnames: list[str]) -> dict[str, Any]:
    # Once per process: the default registry refuses a name twice, and vLLM only unregisters `vllm:*` ones.
    global _families
    if _families is None:
        _families = {name: metric_types[kind](name, doc, [*labelnames, *labels])
                     for name, (kind, doc, labels) in _SPEC_OF.items()}
    return _families


class KvbmPromMetrics(KVConnectorPromMetrics):
    """The worker process's side: the same families, labelled as vLLM labels its own (model_name, engine)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.families = _create_families(metric_types, labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for kind, op in (("counters", "inc"), ("gauges", "set")):
            for name, by_tier in transfer_stats_data.get(kind, {}).items():
                family = self.families.get(name)
                if family is None:
                    continue
                for tier, v in by_tier.items():
                    child = family.labels(*values, tier) if tier else family.labels(*values)
                    getattr(child, op)(v)


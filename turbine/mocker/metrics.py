"""Prometheus gauges of the simulated engines (beside the worker metrics every worker has),
one labelled series per simulated worker, set when /metrics is scraped."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from turbine.mocker.scheduler import Scheduler
from turbine.worker.worker_metrics import LABELS

_blocks_in_use = Gauge("turbine_mocker_kv_blocks_in_use", "KV blocks held by running sequences", LABELS)
_blocks_cached = Gauge("turbine_mocker_kv_blocks_cached",
                       "KV blocks no sequence holds that keep their prefix for reuse (LRU pool)", LABELS)
_waiting = Gauge("turbine_mocker_waiting_sequences",
                 "sequences in the waiting queue, including those pulling their KV from a prefill worker", LABELS)
_running = Gauge("turbine_mocker_running_sequences", "sequences in the running batch", LABELS)
_lora_swaps = Counter("turbine_mocker_lora_swaps", "LoRA adapters brought into an active slot (--enable-lora)", LABELS)
# The simulated KV tiers (--kv-host-cache-gb, --kv-disk-cache-gb): the real worker's turbine_kvbm_* families
# (turbine/kvbm/metrics.py), named apart (a process may hold both) and summed over the worker's ranks.
_TIER = [*LABELS, "tier"]
_tier_counters = {
    "stored": Counter("turbine_mocker_kvbm_blocks_stored", "blocks written to a simulated KV tier (saves, promotions)",
                      _TIER),
    "removed": Counter("turbine_mocker_kvbm_blocks_removed", "blocks a simulated KV tier's LRU dropped", _TIER),
    "hits": Counter("turbine_mocker_kvbm_hits", "blocks a simulated KV tier loaded into the engine", _TIER),
    "bytes_read": Counter("turbine_mocker_kvbm_bytes_read", "KV bytes loaded from a simulated tier", _TIER),
    "read_seconds": Counter("turbine_mocker_kvbm_read_seconds",
                            "simulated time of the loads from a tier (unscaled by --speedup-ratio)", _TIER),
}
_tier_blocks = Gauge("turbine_mocker_kvbm_tier_blocks", "blocks a simulated KV tier holds", _TIER)


class EngineGauges:
    def __init__(self, labels: dict[str, str], schedulers: list[Scheduler]):
        """One series per worker: the sums over its data-parallel ranks' schedulers."""
        values = [labels[name] for name in LABELS]
        self._schedulers = schedulers
        self._in_use, self._cached = _blocks_in_use.labels(*values), _blocks_cached.labels(*values)
        self._waiting, self._running = _waiting.labels(*values), _running.labels(*values)
        self._lora_swaps, self._swaps_counted = _lora_swaps.labels(*values), 0
        tiers = [s.tiers for s in schedulers if s.tiers is not None]
        self._tiers = tiers
        names = [spec.name for spec in tiers[0].specs] if tiers else []
        self._tier_series = {(key, name): c.labels(*values, name)
                             for key, c in _tier_counters.items() for name in names}
        self._tier_gauges = {name: _tier_blocks.labels(*values, name) for name in names}
        self._tier_counted = dict.fromkeys(self._tier_series, 0)

    def refresh(self) -> None:
        scheds = self._schedulers
        self._in_use.set(sum(s.pool.num_in_use for s in scheds))
        self._cached.set(sum(len(s.pool.evictable) for s in scheds))
        self._waiting.set(sum(len(s.waiting) + len(s.pulling) for s in scheds))
        self._running.set(sum(len(s.running) for s in scheds))
        swaps = sum(s.lora_slots.swaps for s in scheds if s.lora_slots is not None)
        self._lora_swaps.inc(swaps - self._swaps_counted)
        self._swaps_counted = swaps
        for (key, name), series in self._tier_series.items():
            total = sum(getattr(t.counts[name], key) for t in self._tiers)
            series.inc(total - self._tier_counted[(key, name)])
            self._tier_counted[(key, name)] = total
        for name, gauge in self._tier_gauges.items():
            gauge.set(sum(t.num_blocks(name) for t in self._tiers))

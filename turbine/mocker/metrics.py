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


class EngineGauges:
    def __init__(self, labels: dict[str, str], schedulers: list[Scheduler]):
        """One series per worker: the sums over its data-parallel ranks' schedulers."""
        values = [labels[name] for name in LABELS]
        self._schedulers = schedulers
        self._in_use, self._cached = _blocks_in_use.labels(*values), _blocks_cached.labels(*values)
        self._waiting, self._running = _waiting.labels(*values), _running.labels(*values)
        self._lora_swaps, self._swaps_counted = _lora_swaps.labels(*values), 0

    def refresh(self) -> None:
        scheds = self._schedulers
        self._in_use.set(sum(s.pool.num_in_use for s in scheds))
        self._cached.set(sum(len(s.pool.evictable) for s in scheds))
        self._waiting.set(sum(len(s.waiting) + len(s.pulling) for s in scheds))
        self._running.set(sum(len(s.running) for s in scheds))
        swaps = sum(s.lora_slots.swaps for s in scheds if s.lora_slots is not None)
        self._lora_swaps.inc(swaps - self._swaps_counted)
        self._swaps_counted = swaps

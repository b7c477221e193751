"""The tiers' Prometheus metrics, one registry per store (its host adds it to its own).

One table (SPECS) defines every family, so a process that only receives the counts (the vLLM
worker's /metrics, fed from the model-runner process: turbine.vllm.kvbm_stats) re-creates the
same names, help and labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# (attribute, kind, name, help, labels); at most one label (the tier)
SPECS: tuple[tuple[str, type, str, str, tuple[str, ...]], ...] = (
    ("stored", Counter, "turbine_kvbm_blocks_stored", "blocks written to a tier (offloads and promotions)",
     ("tier",)),
    ("removed", Counter, "turbine_kvbm_blocks_removed", "blocks a tier dropped (eviction, corruption, removal)",
     ("tier",)),
    ("hits", Counter, "turbine_kvbm_hits", "lookups served by a tier (the fastest that held the block)", ("tier",)),
    ("misses", Counter, "turbine_kvbm_misses", "lookups that no tier could serve", ()),
    ("bytes_written", Counter, "turbine_kvbm_bytes_written", "payload bytes written to a tier", ("tier",)),
    ("bytes_read", Counter, "turbine_kvbm_bytes_read", "payload bytes read from a tier", ("tier",)),
    ("corrupt", Counter, "turbine_kvbm_corrupt_blocks", "block files that failed their check on read (or, in the "
     "vLLM connector, before they were offered) and were dropped", ("tier",)),
    ("load_errors", Counter, "turbine_kvbm_load_errors", "blocks the vLLM connector offered to the engine and then "
     "could not load (gone, or changed since their check), with the rest of each such prompt's offer: reported to "
     "vLLM, which recomputes them", ()),
    ("filtered", Counter, "turbine_kvbm_writes_filtered", "blocks a tier's frequency filter kept out (used "
     "fewer times than its minimum, --kv-disk-min-uses)", ("tier",)),
    ("write_errors", Counter, "turbine_kvbm_write_errors", "writes a tier's filesystem refused", ("tier",)),
    ("write_seconds", Counter, "turbine_kvbm_write_seconds", "time spent writing blocks to a tier", ("tier",)),
    ("read_seconds", Counter, "turbine_kvbm_read_seconds", "time spent reading blocks from a tier (hits, misses "
     "and failed checks)", ("tier",)),
    ("step_load_seconds", Counter, "turbine_kvbm_step_load_seconds", "time the engine's steps spent on the vLLM "
     "connector's loads before their forward pass (reading the tiers, issuing the copies into the engine's cache)",
     ()),
    ("step_save_seconds", Counter, "turbine_kvbm_step_save_seconds", "time the engine's steps spent handing their "
     "new blocks to the vLLM connector after their forward pass (on a GPU: issuing the copies out; the tiers' "
     "writes run in the background)", ()),
    ("tier_disabled", Gauge, "turbine_kvbm_tier_disabled", "1 when a tier stopped writing (a full disk)",
     ("tier",)),
    ("used_bytes", Gauge, "turbine_kvbm_tier_used_bytes", "bytes a tier holds (the shared tier: an estimate)",
     ("tier",)),
)


class KvbmMetrics:
    stored: Counter
    removed: Counter
    hits: Counter
    misses: Counter
    bytes_written: Counter
    bytes_read: Counter
    corrupt: Counter
    load_errors: Counter
    filtered: Counter
    write_errors: Counter
    write_seconds: Counter
    read_seconds: Counter
    step_load_seconds: Counter
    step_save_seconds: Counter
    tier_disabled: Gauge
    used_bytes: Gauge

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        for attr, kind, name, doc, labels in SPECS:
            setattr(self, attr, kind(name, doc, list(labels), registry=r))

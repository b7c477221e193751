"""The tiers' Prometheus metrics, one registry per store (its host adds it to its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KvbmMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.stored = Counter("turbine_kvbm_blocks_stored", "blocks written to a tier (offloads and promotions)",
                              ["tier"], registry=r)
        self.removed = Counter("turbine_kvbm_blocks_removed", "blocks a tier dropped (eviction, corruption, removal)",
                               ["tier"], registry=r)
        self.hits = Counter("turbine_kvbm_hits", "lookups served by a tier (the fastest that held the block)",
                            ["tier"], registry=r)
        self.misses = Counter("turbine_kvbm_misses", "lookups that no tier could serve", registry=r)
        self.bytes_written = Counter("turbine_kvbm_bytes_written", "payload bytes written to a tier", ["tier"],
                                     registry=r)
        self.bytes_read = Counter("turbine_kvbm_bytes_read", "payload bytes read from a tier", ["tier"], registry=r)
        self.corrupt = Counter("turbine_kvbm_corrupt_blocks", "block files that failed their check on read and "
                               "were dropped", ["tier"], registry=r)
        self.write_errors = Counter("turbine_kvbm_write_errors", "writes a tier's filesystem refused", ["tier"],
                                    registry=r)
        self.tier_disabled = Gauge("turbine_kvbm_tier_disabled", "1 when a tier stopped writing (a full disk)",
                                   ["tier"], registry=r)
        self.used_bytes = Gauge("turbine_kvbm_tier_used_bytes", "bytes a tier holds (the shared tier: an estimate)",
                                ["tier"], registry=r)

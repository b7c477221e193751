"""Approximate KV index: learned from the router's own decisions instead of engine events.

When a request is routed, its prefix blocks are assumed cached on the chosen worker for a
while (the TTL); a worker that leaves takes its entries with it. Used with
`--no-router-kv-events`, when workers publish no KV events.
"""

from __future__ import annotations

import time

from turbine.router.indexer import WorkerKey

DEFAULT_TTL_S = 120.0
MAX_ENTRIES = 1 << 20


class ApproxKvIndexer:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = MAX_ENTRIES, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._expiry: dict[int, dict[WorkerKey, float]] = {}  # block hash -> worker -> expiry time
        self._size = 0

    def record(self, worker: WorkerKey, hashes: list[int]) -> None:
        expires = self._clock() + self.ttl_s
        for h in hashes:
            holders = self._expiry.setdefault(h, {})
            if worker not in holders:
                self._size += 1
            holders[worker] = expires
        if self._size > self.max_entries:
            self.prune(target=int(self.max_entries * 0.8))

    def find_matches(self, hashes: list[int]) -> dict[WorkerKey, int]:
        now = self._clock()
        scores: dict[WorkerKey, int] = {}
        candidates: set[WorkerKey] | None = None
        for depth, h in enumerate(hashes):
            live = {w for w, t in self._expiry.get(h, {}).items() if t > now}
            candidates = live if candidates is None else candidates & live
            if not candidates:
                break
            for w in candidates:
                scores[w] = depth + 1
        return scores

    def remove_worker(self, worker: WorkerKey) -> None:
        self._remove(lambda w: w == worker)

    def remove_instance(self, instance_id: str) -> None:
        """Every data-parallel rank of an instance goes (it left discovery)."""
        self._remove(lambda w: w.instance_id == instance_id)

    def _remove(self, gone) -> None:
        for h in list(self._expiry):
            holders = self._expiry[h]
            for w in [w for w in holders if gone(w)]:
                del holders[w]
                self._size -= 1
            if not holders:
                del self._expiry[h]

    def prune(self, target: int = 0) -> None:
        """Drop expired entries; then, if still over `target`, the ones expiring soonest."""
        now = self._clock()
        entries = [(t, h, w) for h, holders in self._expiry.items() for w, t in holders.items()]
        keep = sorted((e for e in entries if e[0] > now), reverse=True)
        if target:
            keep = keep[:target]
        self._expiry = {}
        for t, h, w in keep:
            self._expiry.setdefault(h, {})[w] = t
        self._size = len(keep)

    def __len__(self) -> int:
        return self._size

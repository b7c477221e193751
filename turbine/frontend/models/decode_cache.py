"""What each decode worker probably still holds in its prefix cache.

Decode workers publish no KV events (the KV they pull would flood the router with blocks that
no prefill routing needs), so the frontend remembers the prompts it had each one serve, for a
while, as the router does without events (`--no-router-kv-events`). That tells how much of a
new prompt a decode worker would compute itself: a follow-up turn of a conversation it just
served is mostly cached there and is cheaper to prefill locally than to hand over.
"""

from __future__ import annotations

import time

from turbine.router.approx import ApproxKvIndexer
from turbine.router.hashing import block_hashes
from turbine.router.indexer import WorkerKey

# Seconds a served prompt counts as cached on its decode worker. vLLM keeps freed blocks until
# the space is needed; under memory pressure they go sooner, and this estimate is too kind.
DECODE_CACHE_TTL_S = 120.0


class DecodeCaches:
    def __init__(self, block_size: int, ttl_s: float = DECODE_CACHE_TTL_S, clock=time.monotonic):
        self.block_size = block_size
        self._index = ApproxKvIndexer(ttl_s, clock=clock)
        self._workers: set[str] = set()

    def cached_tokens(self, instance_id: str, token_ids: list[int]) -> int:
        """Leading prompt tokens (whole blocks) the decode worker likely has cached."""
        if instance_id not in self._workers:
            return 0
        blocks = self._index.find_matches(block_hashes(token_ids, self.block_size)).get(WorkerKey(instance_id), 0)
        return blocks * self.block_size

    def served(self, instance_id: str, token_ids: list[int]) -> None:
        """The decode worker computed or pulled this prompt's KV."""
        self._workers.add(instance_id)
        self._index.record(WorkerKey(instance_id), block_hashes(token_ids, self.block_size))

    def keep_only(self, instance_ids: set[str]) -> None:
        """Forget workers that left (a restarted worker comes back with an empty cache)."""
        for gone in self._workers - instance_ids:
            self._index.remove_worker(WorkerKey(gone))
        self._workers &= instance_ids

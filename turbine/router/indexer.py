"""Which worker holds which prefix blocks, mirrored from the workers' KV events.

Blocks are indexed by the router's own chained hash (turbine.router.hashing), which names a
whole prefix, so "longest cached prefix on worker W" is a walk along the request's hashes
while W still holds each one. Engines identify blocks by their own hashes; each worker's
map from engine hash to router hash is kept for removals and for chaining children.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from turbine.router.hashing import block_hashes

log = logging.getLogger("turbine.router")


class WorkerKey(NamedTuple):
    instance_id: str
    dp_rank: int = 0


class KvIndexer:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._holders: dict[int, set[WorkerKey]] = {}  # router hash -> workers holding it
        self._engine_to_router: dict[WorkerKey, dict[int, int]] = {}
        # Per worker, how many engine blocks map to each router hash: engines may hold the
        # same prefix under two engine hashes (e.g. hashes salted by inputs we don't hash).
        self._refs: dict[WorkerKey, dict[int, int]] = {}
        self.events_applied = 0

    # -- events -----------------------------------------------------------------------
    def apply(self, worker: WorkerKey, event: KvEvent, lora_name: str | None = None) -> None:
        if isinstance(event, BlockStored):
            self.stored(worker, event, lora_name)
        elif isinstance(event, BlockRemoved):
            self.removed(worker, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_worker(worker)
        self.events_applied += 1

    def stored(self, worker: WorkerKey, event: BlockStored, lora_name: str | None = None) -> None:
        if event.block_size != self.block_size:
            raise ValueError(f"worker {worker.instance_id} uses KV block size {event.block_size}, "
                             f"the router {self.block_size}")
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            raise ValueError(f"stored event of worker {worker.instance_id}: {len(event.token_ids)} tokens "
                             f"for {len(event.block_hashes)} blocks of {event.block_size}")
        mapping = self._engine_to_router.setdefault(worker, {})
        refs = self._refs.setdefault(worker, {})
        parent = None
        if event.parent_hash is not None:
            parent = mapping.get(event.parent_hash)
            if parent is None:
                # The parent is unknown (evicted, or an event was missed): these blocks cannot
                # be placed in a prefix, and matching stops at a missing parent anyway.
                log.debug("worker %s stored blocks under an unknown parent; ignored", worker.instance_id)
                return
        ours = block_hashes(event.token_ids, self.block_size, lora_name=lora_name, parent=parent)
        for engine_hash, h in zip(event.block_hashes, ours):
            if engine_hash in mapping:
                continue  # already known (a re-sent event)
            mapping[engine_hash] = h
            refs[h] = refs.get(h, 0) + 1
            self._holders.setdefault(h, set()).add(worker)

    def removed(self, worker: WorkerKey, engine_hashes: Iterable[int]) -> None:
        mapping = self._engine_to_router.get(worker)
        if not mapping:
            return
        refs = self._refs[worker]
        for engine_hash in engine_hashes:
            h = mapping.pop(engine_hash, None)
            if h is None:
                continue
            refs[h] -= 1
            if refs[h] == 0:
                del refs[h]
                self._drop(h, worker)

    def remove_worker(self, worker: WorkerKey) -> None:
        """All of a worker's blocks go: it cleared its cache, or it left discovery."""
        self._engine_to_router.pop(worker, None)
        for h in self._refs.pop(worker, {}):
            self._drop(h, worker)

    def _drop(self, h: int, worker: WorkerKey) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]

    # -- queries ----------------------------------------------------------------------
    def find_matches(self, hashes: list[int]) -> dict[WorkerKey, int]:
        """Number of leading blocks of `hashes` each worker holds (workers with none omitted)."""
        scores: dict[WorkerKey, int] = {}
        candidates: set[WorkerKey] | None = None
        for depth, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            candidates = set(holders) if candidates is None else candidates & holders
            if not candidates:
                break
            for w in candidates:
                scores[w] = depth + 1
        return scores

    def workers(self) -> list[WorkerKey]:
        return list(self._engine_to_router)

    def blocks_of(self, worker: WorkerKey) -> int:
        return len(self._refs.get(worker, ()))

    def __len__(self) -> int:
        return len(self._holders)

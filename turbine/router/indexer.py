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
from turbine.router.hashing import packed_block_hashes

log = logging.getLogger("turbine.router")


class WorkerKey(NamedTuple):
    instance_id: str
    dp_rank: int = 0


class KvIndexer:
    def __init__(self, block_size: int):
        self.block_size = block_size
        # router hash -> the workers holding it, as a bit mask over worker slots (bit i: the
        # worker in slot i). Ints rather than a set per block: a holder-set intersection is one
        # `&`, and a million indexed blocks are a million ints the garbage collector never scans.
        self._holders: dict[int, int] = {}
        self._slot: dict[WorkerKey, int] = {}  # worker -> its slot
        self._slot_worker: list[WorkerKey | None] = []  # slot -> worker
        self._free_slots: list[int] = []
        self._engine_to_router: dict[WorkerKey, dict[int, int]] = {}
        # Per worker, how many engine blocks map to each router hash: engines may hold the
        # same prefix under two engine hashes (e.g. hashes salted by inputs we don't hash).
        self._refs: dict[WorkerKey, dict[int, int]] = {}
        self.events_applied = 0
        # Events applied per worker instance, kept when its blocks go (AllBlocksCleared): what
        # the event watchdog reads to tell that a worker's events still arrive.
        self.events_of: dict[str, int] = {}

    # -- events -----------------------------------------------------------------------
    def apply(self, worker: WorkerKey, event: KvEvent, lora_name: str | None = None) -> None:
        if isinstance(event, BlockStored):
            self.stored(worker, event, lora_name)
        elif isinstance(event, BlockRemoved):
            self.removed(worker, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_worker(worker)
        self.events_applied += 1
        self.events_of[worker.instance_id] = self.events_of.get(worker.instance_id, 0) + 1

    def _bit(self, worker: WorkerKey) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_worker[slot] = worker
            else:
                slot = len(self._slot_worker)
                self._slot_worker.append(worker)
            self._slot[worker] = slot
        return 1 << slot

    def stored(self, worker: WorkerKey, event: BlockStored, lora_name: str | None = None) -> None:
        if event.block_size != self.block_size:
            raise ValueError(f"worker {worker.instance_id} uses KV block size {event.block_size}, "
                             f"the router {self.block_size}")
        if len(event.tokens) != len(event.block_hashes) * event.block_size * 4:
            raise ValueError(f"stored event of worker {worker.instance_id}: {len(event.tokens)} bytes of tokens "
                             f"(4 per token) for {len(event.block_hashes)} blocks of {event.block_size}")
        if event.media_keys is not None and len(event.media_keys) != len(event.block_hashes):
            raise ValueError(f"stored event of worker {worker.instance_id}: {len(event.media_keys)} media keys "
                             f"for {len(event.block_hashes)} blocks")
        mapping = self._engine_to_router.get(worker)
        if mapping is None:
            mapping = self._engine_to_router[worker] = {}
            self._refs[worker] = {}
        refs = self._refs[worker]
        parent = None
        if event.parent_hash is not None:
            parent = mapping.get(event.parent_hash)
            if parent is None:
                # The parent is unknown (evicted, or an event was missed): these blocks cannot
                # be placed in a prefix, and matching stops at a missing parent anyway.
                log.debug("worker %s stored blocks under an unknown parent; ignored", worker.instance_id)
                return
        # Hashed straight from the wire's packed tokens: no token is ever a Python int here.
        ours = packed_block_hashes(event.tokens, self.block_size, lora_name=lora_name, parent=parent,
                                   media_keys=event.media_keys)
        bit = self._bit(worker)
        holders = self._holders
        for engine_hash, h in zip(event.block_hashes, ours):
            if engine_hash in mapping:
                continue  # already known (a re-sent event)
            mapping[engine_hash] = h
            n = refs.get(h)
            if n is None:
                refs[h] = 1
                holders[h] = holders.get(h, 0) | bit
            else:
                refs[h] = n + 1

    def removed(self, worker: WorkerKey, engine_hashes: Iterable[int]) -> None:
        mapping = self._engine_to_router.get(worker)
        if not mapping:
            return
        refs = self._refs[worker]
        holders = self._holders
        keep = ~self._bit(worker)
        pop = mapping.pop
        for engine_hash in engine_hashes:
            h = pop(engine_hash, None)
            if h is None:
                continue
            n = refs[h] - 1
            if n:
                refs[h] = n
                continue
            del refs[h]
            mask = holders.get(h, 0) & keep
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def remove_worker(self, worker: WorkerKey) -> None:
        """All of a worker's blocks go: it cleared its cache, or it left discovery."""
        self._engine_to_router.pop(worker, None)
        refs = self._refs.pop(worker, {})
        slot = self._slot.pop(worker, None)
        if slot is None:
            return
        keep = ~(1 << slot)
        holders = self._holders
        for h in refs:
            mask = holders.get(h, 0) & keep
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)
        self._slot_worker[slot] = None
        self._free_slots.append(slot)

    def remove_instance(self, instance_id: str) -> None:
        """Every data-parallel rank of an instance goes (it left discovery)."""
        for worker in [w for w in {*self._slot, *self._engine_to_router} if w.instance_id == instance_id]:
            self.remove_worker(worker)
        self.events_of.pop(instance_id, None)

    # -- queries ----------------------------------------------------------------------
    def find_matches(self, hashes: list[int]) -> dict[WorkerKey, int]:
        """Number of leading blocks of `hashes` each worker holds (workers with none omitted)."""
        get = self._holders.get
        candidates = 0  # workers holding every block so far (bit mask)
        dropped: list[tuple[int, int]] = []  # (workers that stopped holding at this depth, depth)
        depth = 0
        for h in hashes:
            held = get(h, 0)
            still = held if depth == 0 else candidates & held
            if still != candidates and depth:
                dropped.append((candidates & ~still, depth))
            candidates = still
            if not still:
                break
            depth += 1
        if candidates:
            dropped.append((candidates, depth))
        scores: dict[WorkerKey, int] = {}
        slot_worker = self._slot_worker
        for mask, score in dropped:
            while mask:
                low = mask & -mask
                scores[slot_worker[low.bit_length() - 1]] = score
                mask ^= low
        return scores

    def workers(self) -> list[WorkerKey]:
        return list(self._engine_to_router)

    def blocks_of(self, worker: WorkerKey) -> int:
        return len(self._refs.get(worker, ()))

    def __len__(self) -> int:
        return len(self._holders)

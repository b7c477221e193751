"""Which worker holds which prefix blocks, mirrored from the workers' KV events.

Blocks are indexed by the router's own chained hash (turbine.router.hashing), which names a
whole prefix, so "longest cached prefix on worker W" is a walk along the request's hashes
while W still holds each one. Engines identify blocks by their own hashes; each worker's
map from engine hash to router hash is kept for removals and for chaining children.

Tiers (`--connector kvbm`, issue #18): a worker also publishes which blocks its offload tiers hold
(events with a `tier`, named by router hashes). Its own tiers (host, disk) are kept per worker, as
the fastest tier holding each block; a shared tier's blocks are kept per shared tier (the id the
workers announce in their cards, `kv_shared_tier`) and count for every worker that sees it.
`tier_matches` continues a worker's engine match through its tiers; the cost weighs those blocks.
Clearing a worker's engine cache (AllBlocksCleared) leaves its tiers. With `follow_tiers` False
(`--no-router-kv-tiers`) tier events are counted and dropped: the index holds the engines' caches only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from turbine.protocol.kv_events import TIERS, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from turbine.router.hashing import packed_block_hashes

log = logging.getLogger("turbine.router")


class WorkerKey(NamedTuple):
    instance_id: str
    dp_rank: int = 0


class KvIndexer:
    def __init__(self, block_size: int, follow_tiers: bool = True):
        self.block_size = block_size
        self.follow_tiers = follow_tiers
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
        self._own_tiers: dict[WorkerKey, dict[int, str]] = {}  # worker -> router hash -> its fastest own tier
        self._shared: dict[str, set[int]] = {}  # shared tier id -> the router hashes it holds
        self._shared_tier_of: dict[str, str] = {}  # instance id -> the shared tier it sees (its card's)

    # -- events -----------------------------------------------------------------------
    def apply(self, worker: WorkerKey, event: KvEvent, lora_name: str | None = None) -> None:
        if getattr(event, "tier", None) is not None:
            if self.follow_tiers:
                self.tier_event(worker, event)
        elif isinstance(event, BlockStored):
            self.stored(worker, event, lora_name)
        elif isinstance(event, BlockRemoved):
            self.removed(worker, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_worker(worker, tiers=False)
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

    # -- tiers ------------------------------------------------------------------------
    def set_shared_tiers(self, shared_tier_of: dict[str, str | None]) -> None:
        """Instance id -> the shared tier id its card announces (None: none), for every live instance;
        a shared tier no live instance sees any more is forgotten."""
        self._shared_tier_of = {i: t for i, t in shared_tier_of.items() if t}
        for gone in self._shared.keys() - set(self._shared_tier_of.values()):
            del self._shared[gone]

    def tier_event(self, worker: WorkerKey, event: BlockStored | BlockRemoved) -> None:
        tier = event.tier
        if tier not in TIERS:
            log.debug("worker %s: event of unknown tier %r ignored", worker.instance_id, tier)
            return
        if isinstance(event, BlockStored) and event.block_size != self.block_size:
            raise ValueError(f"worker {worker.instance_id} uses KV block size {event.block_size}, "
                             f"the router {self.block_size}")
        stored = isinstance(event, BlockStored)
        if tier == "shared":
            shared_id = self._shared_tier_of.get(worker.instance_id)
            if shared_id is None:
                return  # its card announces no shared tier (or not yet): nobody to count them for
            blocks = self._shared.setdefault(shared_id, set())
            if stored:
                blocks.update(event.block_hashes)
            else:
                blocks.difference_update(event.block_hashes)  # the file is gone: for every worker
            return
        own = self._own_tiers.setdefault(worker, {})
        for h in event.block_hashes:
            if stored:
                own[h] = tier
            else:
                own.pop(h, None)

    def tier_matches(self, hashes: list[int], workers: Iterable[WorkerKey],
                     engine: dict[WorkerKey, int]) -> dict[WorkerKey, list[str]]:
        """Per worker, the tier of each block after its engine match (`engine`, find_matches) for as long
        as one of its own tiers or the shared tier it sees holds the next block (workers with none omitted)."""
        out: dict[WorkerKey, list[str]] = {}
        for w in workers:
            own = self._own_tiers.get(w)
            shared = self._shared.get(self._shared_tier_of.get(w.instance_id, ""))
            if not own and not shared:
                continue
            tiers = []
            for h in hashes[engine.get(w, 0):]:
                tier = own.get(h) if own else None
                if tier is None and shared and h in shared:
                    tier = "shared"
                if tier is None:
                    break
                tiers.append(tier)
            if tiers:
                out[w] = tiers
        return out

    def tier_blocks_of(self, worker: WorkerKey) -> int:
        return len(self._own_tiers.get(worker, ()))

    def remove_worker(self, worker: WorkerKey, tiers: bool = True) -> None:
        """All of a worker's blocks go: it cleared its cache (`tiers`=False: its engine's only), or it
        left discovery, or a snapshot of it replaces them."""
        if tiers:
            self._own_tiers.pop(worker, None)
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
        for worker in [w for w in {*self._slot, *self._engine_to_router, *self._own_tiers}
                       if w.instance_id == instance_id]:
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

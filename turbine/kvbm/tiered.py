"""Tiers in one store: write-through, fastest-first lookup with promotion, and the events.

Tiers are ordered fastest first (host, disk, shared). A put writes the block to every tier that
takes writes; a get reads from the fastest tier holding it and copies it into the faster tiers
(promotion), so a block read from disk is next served from memory.

Two event streams, both taken by polling (like vLLM's connector `take_events`):
- per tier: `TierEvent(stored | removed, tier, hash)` each time a tier gains or loses a block;
- consolidated: `BlockEvent` stored when a block first appears in any tier, removed only when it
  is gone from all of them; each names the tier that caused it. This is what the router follows.
The shared tier's blocks written by other workers appear here when a lookup first finds them;
blocks other workers evict from it are noticed when a lookup misses them.

Frequency filter (`min_uses`, per tier; the seeds' "offload to disk only what is reused"): a tier
with min_uses N takes a block only once the block has been used N times, a use being a put (the
engine computed it) or a hit in any tier. A block that reaches N on a hit is then written to the
filtered tiers that lack it. Uses are counted for the most recent USES_TRACKED hashes only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from turbine.kvbm.block import Block
from turbine.kvbm.metrics import KvbmMetrics
from turbine.kvbm.store import BlockStore

Kind = Literal["stored", "removed"]

USES_TRACKED = 1 << 18  # hashes whose use count is kept (least recently used forgotten): a few MB


@dataclass(frozen=True, slots=True)
class TierEvent:
    kind: Kind
    tier: str
    block_hash: int


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Consolidated: `tier` is where the block first appeared (stored) or the last tier it left (removed)."""

    kind: Kind
    tier: str
    block_hash: int
    parent_hash: int | None = None  # known for stored events (the router places a block under its parent)


class TieredStore:
    def __init__(self, tiers: list[BlockStore], metrics: KvbmMetrics | None = None,
                 min_uses: dict[str, int] | None = None):
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        for name, n in (min_uses or {}).items():
            if name not in names or n < 1:
                raise ValueError(f"min_uses: {name}={n} (a tier of {names}, at least 1)")
        self.tiers = list(tiers)
        self.min_uses = {name: n for name, n in (min_uses or {}).items() if n > 1}
        self._uses: OrderedDict[int, int] = OrderedDict()  # block hash -> uses (puts and hits), bounded
        self.metrics = metrics or KvbmMetrics()
        self._where: dict[int, set[str]] = {}  # block hash -> the tiers holding it, as this process knows
        self._lock = threading.Lock()
        self._tier_events: list[TierEvent] = []
        self._events: list[BlockEvent] = []
        for t in self.tiers:
            t.on_removed = self._tier_dropped
            if getattr(t, "metrics", False) is None:
                t.metrics = self.metrics  # file tiers count corruption and write errors here
            self.metrics.used_bytes.labels(t.name).set_function(t.used_bytes)
            self.metrics.tier_disabled.labels(t.name).set(0 if t.writable else 1)

    # -- writes ---------------------------------------------------------------------------------
    def put(self, block: Block) -> list[str]:
        """Writes through every tier that takes writes (and whose frequency filter lets the block in);
        returns the tiers that now hold it."""
        uses = self._used(block.block_hash)
        return [t.name for t in self.tiers if self._admitted(t, uses) and self._put_one(t, block)]

    def put_many(self, blocks: list[Block]) -> list[list[str]]:
        """`put` of each block, each tier taking its blocks together (the disk tier's writer process writes them in
        one exchange); returns, per block, the tiers that now hold it."""
        uses = [self._used(block.block_hash) for block in blocks]
        held: list[list[str]] = [[] for _ in blocks]
        for tier in self.tiers:
            if not tier.writable:
                continue
            mine = [i for i, n in enumerate(uses) if self._admitted(tier, n)]
            if not mine:
                continue
            # What the tier drops during the batch (blocks of this batch among them) is applied after the batch's
            # blocks are recorded, so that a block stored and then evicted within the batch ends up removed.
            dropped: list[tuple[str, int]] = []
            tier.on_removed = lambda name, block_hash: dropped.append((name, block_hash))
            start = time.perf_counter()
            try:
                written = tier.put_many([blocks[i] for i in mine])
            finally:
                tier.on_removed = self._tier_dropped
            self.metrics.write_seconds.labels(tier.name).inc(time.perf_counter() - start)
            for i, ok in zip(mine, written):
                if ok:
                    self._record_put(tier, blocks[i])
                    held[i].append(tier.name)
            for name, block_hash in dropped:
                self._tier_dropped(name, block_hash)
        return held

    def _used(self, block_hash: int) -> int:
        """Counts one use of the block; returns its uses so far (1 when not tracked, or no filter)."""
        if not self.min_uses:
            return 1
        with self._lock:
            n = self._uses.pop(block_hash, 0) + 1
            self._uses[block_hash] = n
            if len(self._uses) > USES_TRACKED:
                self._uses.popitem(last=False)
        return n

    def _admitted(self, tier: BlockStore, uses: int) -> bool:
        need = self.min_uses.get(tier.name, 1)
        if uses < need:
            self.metrics.filtered.labels(tier.name).inc()
            return False
        return True

    def _put_one(self, tier: BlockStore, block: Block) -> bool:
        if not tier.writable:
            return False
        start = time.perf_counter()
        written = tier.put(block)
        self.metrics.write_seconds.labels(tier.name).inc(time.perf_counter() - start)
        if not written:
            return False
        self._record_put(tier, block)
        return True

    def _record_put(self, tier: BlockStore, block: Block) -> None:
        if self._gained(tier.name, block.block_hash, block.parent_hash):
            self.metrics.stored.labels(tier.name).inc()
            self.metrics.bytes_written.labels(tier.name).inc(block.nbytes)

    def remove(self, block_hash: int) -> None:
        """Drops the block from every tier."""
        for t in self.tiers:
            if t.remove(block_hash) or t.name in self._where.get(block_hash, ()):
                self._tier_dropped(t.name, block_hash)

    def drop_corrupt(self, name: str, block_hash: int) -> None:
        """A tier's copy that someone else found corrupt (the vLLM connector's scheduler half checks file
        blocks before offering them, and unlinks a bad file): removed from that tier, counted in
        `turbine_kvbm_corrupt_blocks_total` and reported, as if this store's own read had found it."""
        self._tier(name).remove(block_hash)
        self.metrics.corrupt.labels(name).inc()
        self._tier_dropped(name, block_hash)

    def clear_tier(self, name: str) -> int:
        """Drops from one tier every block this process knows it holds; returns how many."""
        tier = self._tier(name)
        with self._lock:
            held = [h for h, where in self._where.items() if name in where]
        for h in held:
            tier.remove(h)
            self._tier_dropped(name, h)
        return len(held)

    def adopt_held(self) -> int:
        """Records as stored what the tiers already held when this process opened them (a disk
        tier's files from an earlier run), so they get events and later removals are reported."""
        n = 0
        for t in self.tiers:
            for h in getattr(t, "held", list)():
                n += self._gained(t.name, h, None)
        return n

    # -- reads ----------------------------------------------------------------------------------
    def get(self, block_hash: int) -> tuple[Block, str] | None:
        """The block and the tier that served it, promoted into the faster tiers; None: no tier has it."""
        return self._served(block_hash, self._read(block_hash))

    def get_many(self, block_hashes: list[int], read_map=map) -> list[tuple[Block, str] | None]:
        """`get` of each, in order, and the tiers left exactly as after one `get` at a time. What the fastest
        tier does not hold is read from the slower ones first, through `read_map` (a thread pool's `map` reads
        files in parallel: their I/O and checksums run outside the GIL and the tiers' locks); then, in order,
        each block is taken from the fastest tier if it is there by then (an earlier one may have promoted or
        evicted it), else from what was read, and served (hits, promotion, frequency counts)."""
        fastest = self.tiers[0]
        slow = [h for h in block_hashes if not fastest.contains(h)]
        prefetched = dict(zip(slow, read_map(lambda h: self._read(h, start=1), slow)))
        out = []
        for h in block_hashes:
            read = self._read(h, stop=1)
            if read is None:
                read = prefetched[h] if h in prefetched else self._read(h, start=1)
            out.append(self._served(h, read))
        return out

    def _read(self, block_hash: int, start: int = 0, stop: int | None = None) -> tuple[Block, int] | None:
        """The block from the fastest tier (of tiers[start:stop]) that has it, and that tier's index; only reads
        (and drops)."""
        for i, tier in enumerate(self.tiers[start:stop], start):
            began = time.perf_counter()
            block = tier.get(block_hash)
            self.metrics.read_seconds.labels(tier.name).inc(time.perf_counter() - began)
            if block is not None:
                return block, i
            # Gone without this process seeing it go (another worker evicted it from the shared tier).
            self._tier_dropped(tier.name, block_hash)
        return None

    def _served(self, block_hash: int, read: tuple[Block, int] | None) -> tuple[Block, str] | None:
        if read is None:
            self.metrics.misses.inc()
            return None
        block, i = read
        tier = self.tiers[i]
        self.metrics.hits.labels(tier.name).inc()
        self.metrics.bytes_read.labels(tier.name).inc(block.nbytes)
        if self._gained(tier.name, block_hash, block.parent_hash):
            self.metrics.stored.labels(tier.name).inc()  # another worker's, found in the shared tier
        uses = self._used(block_hash)
        for faster in self.tiers[:i]:
            if self._admitted(faster, uses):
                self._put_one(faster, block)
        for slower in self.tiers[i + 1:]:
            # A filtered tier takes the block once it has been used often enough.
            if (uses >= self.min_uses.get(slower.name, 1) > 1
                    and slower.name not in self.tiers_of(block_hash)):
                self._put_one(slower, block)
        return block, tier.name

    def locate(self, block_hash: int) -> str | None:
        """The fastest tier that holds it (without reading it: a get may still miss)."""
        for t in self.tiers:
            if t.contains(block_hash):
                return t.name
        return None

    def match_prefix(self, block_hashes: list[int]) -> list[str]:
        """For the longest leading run of `block_hashes` some tier holds, each block's fastest tier."""
        found = []
        for h in block_hashes:
            tier = self.locate(h)
            if tier is None:
                break
            found.append(tier)
        return found

    def tiers_of(self, block_hash: int) -> frozenset[str]:
        with self._lock:
            return frozenset(self._where.get(block_hash, ()))

    # -- events ---------------------------------------------------------------------------------
    def take_tier_events(self) -> list[TierEvent]:
        with self._lock:
            out, self._tier_events = self._tier_events, []
        return out

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def _gained(self, tier: str, block_hash: int, parent: int | None) -> bool:
        with self._lock:
            where = self._where.setdefault(block_hash, set())
            if tier in where:
                return False
            if not where:
                self._events.append(BlockEvent("stored", tier, block_hash, parent))
            where.add(tier)
            self._tier_events.append(TierEvent("stored", tier, block_hash))
            return True

    def _tier_dropped(self, tier: str, block_hash: int) -> None:
        with self._lock:
            where = self._where.get(block_hash)
            if where is None or tier not in where:
                return
            where.discard(tier)
            self._tier_events.append(TierEvent("removed", tier, block_hash))
            if not where:
                del self._where[block_hash]
                self._events.append(BlockEvent("removed", tier, block_hash))
        self.metrics.removed.labels(tier).inc()

    def _tier(self, name: str) -> BlockStore:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r} (tiers: {', '.join(t.name for t in self.tiers)})")

"""The simulated KV offload tiers of one engine: the real worker's `--connector kvbm`
(turbine/vllm/kvbm_connector.py, turbine/kvbm) as block counts and a bandwidth model.

- Blocks are named by the router's chained hash (turbine.router.hashing), as turbine.kvbm names
  them. A tier holds no data: only which hashes it has, least recently used first, up to its
  capacity in blocks.
- Saves are write-through, as the real connector's: a full block the engine computes goes to every
  tier, unless some tier holds it already (the connector saves only blocks no tier has). So a block
  the engine evicts is still in the tiers, until their own LRU drops it.
- Loads: a prompt that continues past the engine's prefix-cache hit onto blocks the tiers hold
  loads them instead of computing them. Each costs block_bytes / its tier's bandwidth, charged to
  the step that admits the request (the connector loads synchronously before the forward pass). A
  load refreshes the block in the tier that served it and copies a disk block into host (promotion).
- Events: the consolidated stream the real connector publishes. The worker's tiers count as one:
  BlockStored(tier=its fastest tier) when a block first appears in one of them and again when its
  fastest tier changes (host evicted it, disk still has it); BlockRemoved when it is gone from all.
  Hashes are the router's; `tokens` is empty and `parent_hash` None, as the connector sends them.

The default bandwidths are the effective rates measured on the real vLLM CPU engine with the real
tiers (benchmarks/kv_tiers/kvbm_tier_weights.py, docs/benchmarks/kv_tiers.md "KV tier weights", 2026-11-27): a 5,898,240-byte
block (128 tokens of SmolLM2-135M in float32) took 2.84 ms more than an engine hit from host memory
and 3.60 ms from the disk tier (its files in the page cache): 2.1 and 1.6 GB/s. Those rates include
everything a load costs the engine, not only the copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from turbine.protocol.kv_events import BlockRemoved, BlockStored, KvEvent

TIER_NAMES = ("host", "disk")  # fastest first
DEFAULT_HOST_BANDWIDTH_GB_S = 2.1
DEFAULT_DISK_BANDWIDTH_GB_S = 1.6


@dataclass(frozen=True)
class TierSpec:
    name: str  # one of TIER_NAMES
    capacity_blocks: int
    bandwidth_bytes_per_s: float

    def __post_init__(self):
        if self.name not in TIER_NAMES:
            raise ValueError(f"tier {self.name!r}: one of {', '.join(TIER_NAMES)}")
        if self.capacity_blocks < 1 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"tier {self.name}: capacity {self.capacity_blocks} blocks and bandwidth "
                             f"{self.bandwidth_bytes_per_s} B/s must be positive")


@dataclass
class TierCounts:
    """One tier's counters since start (the metrics read them)."""

    stored: int = 0  # blocks written (saves and promotions)
    removed: int = 0  # blocks its LRU dropped
    hits: int = 0  # blocks it served to the engine
    bytes_read: int = 0
    read_seconds: float = 0.0  # simulated, unscaled


@dataclass
class KvTiers:
    specs: Sequence[TierSpec]
    block_size: int  # tokens per block (the router checks it)
    block_bytes: int  # KV bytes of one block
    on_event: Callable[[KvEvent], None] | None = None  # where the consolidated events go
    counts: dict[str, TierCounts] = field(init=False)

    def __post_init__(self):
        names = [s.name for s in self.specs]
        if not names or names != [n for n in TIER_NAMES if n in names]:
            raise ValueError(f"tiers {names}: at least one, distinct, fastest first ({', '.join(TIER_NAMES)})")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        self._held: dict[str, OrderedDict[int, None]] = {s.name: OrderedDict() for s in self.specs}
        self.counts = {s.name: TierCounts() for s in self.specs}
        self._capacity = {s.name: s.capacity_blocks for s in self.specs}
        self._bandwidth = {s.name: s.bandwidth_bytes_per_s for s in self.specs}
        self._pending: list[tuple[bool, str, int]] = []  # (stored?, tier, hash), flushed as events

    def num_blocks(self, tier: str) -> int:
        return len(self._held[tier])

    def fastest(self, block_hash: int) -> str | None:
        return next((name for name, held in self._held.items() if block_hash in held), None)

    def match(self, hashes: Sequence[int]) -> list[str]:
        """For the longest leading run of `hashes` some tier holds, each block's fastest tier."""
        found = []
        for h in hashes:
            tier = self.fastest(h)
            if tier is None:
                break
            found.append(tier)
        return found

    def load(self, hashes: Sequence[int], tiers: Sequence[str]) -> float:
        """Loads these blocks (as `match` found them) into the engine; returns the unscaled seconds."""
        seconds = 0.0
        for h, tier in zip(hashes, tiers):
            held = self._held[tier]
            if h in held:  # (promoting an earlier block of the prompt may have pushed it out of a small tier)
                held.move_to_end(h)
            c = self.counts[tier]
            c.hits += 1
            c.bytes_read += self.block_bytes
            t = self.block_bytes / self._bandwidth[tier]
            c.read_seconds += t
            seconds += t
            for faster in self._held:  # promotion into every faster tier
                if faster == tier:
                    break
                self._put(faster, h)
        self._flush()
        return seconds

    def save(self, hashes: Sequence[int]) -> None:
        """Blocks the engine computed: written to every tier, unless a tier holds them already."""
        for h in hashes:
            if self.fastest(h) is None:
                for tier in self._held:
                    self._put(tier, h)
        self._flush()

    def _put(self, tier: str, h: int) -> None:
        held = self._held[tier]
        if h in held:
            held.move_to_end(h)
            return
        before = self.fastest(h)
        held[h] = None
        self.counts[tier].stored += 1
        self._changed(h, before)
        while len(held) > self._capacity[tier]:
            old = next(iter(held))  # the least recently used
            before = self.fastest(old)
            del held[old]
            self.counts[tier].removed += 1
            self._changed(old, before)

    def _changed(self, h: int, before: str | None) -> None:
        """The consolidated stream: a change of the block's fastest tier (None: in no tier)."""
        after = self.fastest(h)
        if after != before:
            self._pending.append((after is not None, after or before, h))

    def _flush(self) -> None:
        """Runs of one kind and tier become one event, in order."""
        pending, self._pending = self._pending, []
        if self.on_event is None:
            return
        run: list[int] = []
        for i, (stored, tier, h) in enumerate(pending):
            run.append(h)
            if i + 1 < len(pending) and pending[i + 1][:2] == (stored, tier):
                continue
            if stored:
                self.on_event(BlockStored(block_hashes=run, parent_hash=None, tokens=b"", block_size=self.block_size,
                                          tier=tier))
            else:
                self.on_event(BlockRemoved(block_hashes=run, tier=tier))
            run = []

"""The interface every tier implements, and the host-memory tier.

A tier is a bounded cache of whole blocks keyed by block hash. It reports what it drops (LRU
eviction, a corrupt file found on read) to its listener, so that the tiered store can tell the
router when a block is gone from every tier.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

from turbine.kvbm.block import Block

# (tier name, block hash): called for every block a tier drops on its own (eviction, corruption),
# never for blocks its caller removed; called with no lock of the tier held.
RemovedListener = Callable[[str, int], None]


class BlockStore(ABC):
    """One tier. Thread-safe: the engine-side connector saves and loads from its own threads."""

    name: str  # "host", "disk", "shared": the tier label of events and metrics

    def __init__(self, name: str, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"{name} tier: capacity_bytes must be > 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.on_removed: RemovedListener | None = None

    @property
    def writable(self) -> bool:
        """False once the tier gave up writing (a full disk); it still serves what it holds."""
        return True

    @abstractmethod
    def put(self, block: Block) -> bool:
        """Stores the block (evicting least recently used ones to make room); False when it
        cannot (larger than the whole tier, tier disabled, write failed). Storing a held hash
        again only refreshes its recency."""

    def put_many(self, blocks: list[Block]) -> list[bool]:
        """`put` of each block, in order (a tier that writes several blocks better together overrides this)."""
        return [self.put(block) for block in blocks]

    @abstractmethod
    def get(self, block_hash: int) -> Block | None:
        """The block, verified, and marks it most recently used; None when absent or corrupt
        (a corrupt copy is dropped and reported to the listener)."""

    @abstractmethod
    def contains(self, block_hash: int) -> bool:
        """Whether the tier (probably) holds it, without reading it: a later get may still find
        it corrupt or, for a shared tier, removed by another worker."""

    @abstractmethod
    def remove(self, block_hash: int) -> bool:
        """Drops it (not reported to the listener: the caller knows); False when absent."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    def _dropped(self, hashes: list[int]) -> None:
        if self.on_removed is not None:
            for h in hashes:
                self.on_removed(self.name, h)


class HostStore(BlockStore):
    """Blocks in this process's memory, bounded by their payload bytes, least recently used out."""

    def __init__(self, capacity_bytes: int, name: str = "host"):
        super().__init__(name, capacity_bytes)
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def put(self, block: Block) -> bool:
        if block.nbytes > self.capacity_bytes:
            return False
        evicted: list[int] = []
        with self._lock:
            if block.block_hash in self._blocks:
                self._blocks.move_to_end(block.block_hash)
                return True
            while self._used + block.nbytes > self.capacity_bytes:
                h, old = self._blocks.popitem(last=False)
                self._used -= old.nbytes
                evicted.append(h)
            self._blocks[block.block_hash] = block
            self._used += block.nbytes
        self._dropped(evicted)
        return True

    def get(self, block_hash: int) -> Block | None:
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
            return block

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def remove(self, block_hash: int) -> bool:
        with self._lock:
            block = self._blocks.pop(block_hash, None)
            if block is None:
                return False
            self._used -= block.nbytes
            return True

    def used_bytes(self) -> int:
        return self._used

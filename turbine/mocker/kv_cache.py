"""The simulated paged KV cache of one worker, with vLLM's prefix-caching rules.

Every block is in exactly one state:
- in use: held by one or more sequences (reference count > 0);
- cached: no holder, but it keeps its contents and its hash, so a later request with the
  same prefix can take it back; these form an LRU pool and are evicted only when an
  allocation finds no empty block;
- empty: no holder and no hash.

A block's hash chains its parent's hash and its own token ids, so equal hashes mean equal
prefixes. Only full blocks are hashed. A sequence frees its blocks last-first, so within one
sequence the suffix is evicted before the prefix that other requests are likelier to share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, pack_token_ids


def block_hash(parent: int | None, token_ids: Sequence[int], lora_name: str | None = None) -> int:
    """64-bit hash of one full block: its parent's hash (None for the first block; then the LoRA
    adapter's name, if any, as vLLM keys an adapter's blocks apart) + its tokens."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    elif lora_name is not None:
        h.update(b"lora\0" + lora_name.encode() + b"\0")
    h.update(array("I", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 on_event: Callable[[KvEvent], None] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.on_event = on_event  # where BlockStored / BlockRemoved / AllBlocksCleared go
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> the block holding it
        # Empty blocks, as a stack: like vLLM, the most recently freed is reused first.
        self.empty: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks without a holder, least recently freed first (evicted first).
        self.evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: the empty ones plus the evictable cached ones."""
        return len(self.empty) + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_available

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `hashes`."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); they leave the LRU pool."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for new tokens: empty ones first, then the least recently used cached."""
        if count > self.num_available:
            raise ValueError(f"cannot allocate {count} blocks: {self.num_available} available")
        blocks, removed = [], []
        for _ in range(count):
            if self.empty:
                block = self.empty.pop()
            else:
                block, _ = self.evictable.popitem(last=False)
                h = self.block_hashes[block]
                del self.cached[h]
                self.block_hashes[block] = None
                removed.append(h)
            self.ref_counts[block] = 1
            blocks.append(block)
        if removed:
            self._emit(BlockRemoved(block_hashes=removed))
        return blocks

    def cache_full_blocks(self, blocks: Sequence[int], hashes: Sequence[int], start: int, end: int,
                          token_ids: Sequence[int], lora_name: str | None = None) -> None:
        """Enter blocks[start:end] of one sequence into the prefix cache. `hashes[i]` is the
        hash of the sequence's block i and `token_ids` its tokens. A block whose hash another
        block already holds (both computed the same prefix at once) stays uncached."""
        if not self.enable_caching:
            return
        run_start = start  # consecutive newly cached blocks share one BlockStored event
        for i in range(start, end):
            h = hashes[i]
            if h in self.cached:
                self._emit_stored(hashes, run_start, i, token_ids, lora_name)
                run_start = i + 1
                continue
            self.block_hashes[blocks[i]] = h
            self.cached[h] = blocks[i]
        self._emit_stored(hashes, run_start, end, token_ids, lora_name)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, given in eviction order (first = evicted first)."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is None:
                    self.empty.append(block)
                else:
                    self.evictable[block] = None

    def reset(self) -> bool:
        """Drop the whole prefix cache; refused (False) while any block is in use."""
        if self.num_in_use:
            return False
        for block in self.evictable:
            self.block_hashes[block] = None
        self.empty.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self._emit(AllBlocksCleared())
        return True

    def _emit_stored(self, hashes: Sequence[int], start: int, end: int, token_ids: Sequence[int],
                     lora_name: str | None = None) -> None:
        if start < end and self.on_event is not None:
            bs = self.block_size
            self._emit(BlockStored(block_hashes=list(hashes[start:end]),
                                   parent_hash=hashes[start - 1] if start else None,
                                   tokens=pack_token_ids(token_ids[start * bs:end * bs]), block_size=bs), lora_name)

    def _emit(self, event: KvEvent, lora_name: str | None = None) -> None:
        """`on_event(event)`, or `on_event(event, lora_name)` for an adapter's stored blocks."""
        if self.on_event is not None:
            if lora_name is None:
                self.on_event(event)
            else:
                self.on_event(event, lora_name)

"""What a worker's prefix cache holds, followed from the KV events it publishes, so that it can
describe the whole of it again (a snapshot) to a router that missed events.

The snapshot must rebuild exactly what a router fed every event would hold. A router can place
a stored block only under a parent it knows, and a block it placed keeps its (chained) identity
after its parent is evicted. So a removed block that still has cached descendants is kept here
as a "ghost": the snapshot stores it, then removes it, exactly as the events did.

Tier events (`tier` set: a worker's offload tiers, named by router hashes) are kept apart, as
hash -> tier for the worker's own tiers and a set for the shared one, and come after the engine's
blocks in a snapshot. Clearing the engine's cache (AllBlocksCleared) leaves the tiers as they are.
"""

from __future__ import annotations

import msgspec

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

SNAPSHOT_BATCH_TOKENS = 1 << 16  # keeps each snapshot batch (and reply frame) well under a MiB or so


class _Block(msgspec.Struct, gc=False):
    """One block. Untracked by the garbage collector (gc=False): a worker holds one per cached
    block, up to its whole pool (16384 on a simulated worker, times 100+ workers in a mocker
    process), and every collector pass would scan them all; only atomic fields, so no cycles."""

    parent: int | None
    tokens: bytes  # the packed tokens of the whole event it came in (shared, 4 bytes each)
    offset: int  # its index among that event's blocks
    block_size: int
    lora_name: str | None
    media_key: int = 0  # its media key (BlockStored.media_keys), 0: none
    live: bool = True  # False: a ghost, removed but kept for its descendants
    children: int = 0  # tracked blocks (live or ghost) whose parent this is


class KvCacheState:
    def __init__(self):
        self._blocks: dict[int, _Block] = {}  # engine block hash -> block
        self._own_tier: dict[int, str] = {}  # router hash -> the fastest of the worker's own tiers holding it
        self._shared: dict[int, None] = {}  # router hashes in the shared tier (ordered: snapshots are stable)
        self._tier_block_size = 0

    def __len__(self) -> int:
        """Live blocks."""
        return sum(b.live for b in self._blocks.values())

    def apply(self, event: KvEvent, lora_name: str | None = None) -> None:
        if getattr(event, "tier", None) is not None:
            self._tier_event(event)
        elif isinstance(event, BlockStored):
            self._stored(event, lora_name)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._removed(h)
        elif isinstance(event, AllBlocksCleared):
            self._blocks.clear()

    def _tier_event(self, event: BlockStored | BlockRemoved) -> None:
        shared = event.tier == "shared"
        if isinstance(event, BlockStored):
            self._tier_block_size = event.block_size
            for h in event.block_hashes:
                if shared:
                    self._shared[h] = None
                else:
                    self._own_tier[h] = event.tier
        else:
            table = self._shared if shared else self._own_tier
            for h in event.block_hashes:
                table.pop(h, None)

    def _stored(self, event: BlockStored, lora_name: str | None) -> None:
        bs = event.block_size
        if bs <= 0 or len(event.tokens) != len(event.block_hashes) * bs * 4:
            return  # malformed: routers reject it too
        parent = event.parent_hash
        if parent is not None and not self._live(parent):
            return  # routers cannot place blocks under a parent they do not know
        tokens = event.tokens  # immutable: kept as is, shared by the event's blocks
        keys = event.media_keys
        if keys is not None and len(keys) != len(event.block_hashes):
            return  # malformed: routers reject it too
        for i, h in enumerate(event.block_hashes):
            key = keys[i] if keys else 0
            block = self._blocks.get(h)
            if block is None or not block.live:
                if block is None:
                    self._blocks[h] = _Block(parent, tokens, i, bs, lora_name, key)
                    self._adopt(parent)
                else:  # a ghost is stored again: it is a cached block once more
                    if block.parent != parent:
                        self._orphan(block.parent)
                        self._adopt(parent)
                    block.parent, block.tokens, block.offset = parent, tokens, i
                    block.block_size, block.lora_name, block.media_key, block.live = bs, lora_name, key, True
            parent = h  # an already cached block is skipped, as routers do; its successors chain on

    def _removed(self, h: int) -> None:
        block = self._blocks.get(h)
        if block is not None and block.live:
            block.live = False
            self._prune(h, block)

    def _live(self, h: int) -> bool:
        block = self._blocks.get(h)
        return block is not None and block.live

    def _adopt(self, parent: int | None) -> None:
        if parent is not None:
            self._blocks[parent].children += 1

    def _orphan(self, parent: int | None) -> None:
        if parent is not None:
            block = self._blocks[parent]
            block.children -= 1
            self._prune(parent, block)

    def _prune(self, h: int, block: _Block) -> None:
        """Forget a ghost without descendants, and so on up its ancestors."""
        while not block.live and block.children == 0:
            del self._blocks[h]
            if block.parent is None:
                return
            h, block = block.parent, self._blocks[block.parent]
            block.children -= 1

    def snapshot(self, instance_id: str, dp_rank: int, event_id: int) -> list[KvEventBatch]:
        """The whole cache as event batches (all numbered `event_id`): runs of blocks stored
        parents first, batches of one LoRA and at most about SNAPSHOT_BATCH_TOKENS tokens, then
        one removal of the ghosts."""
        children: dict[int | None, list[int]] = {}
        for h, block in self._blocks.items():
            children.setdefault(block.parent, []).append(h)
        batches: list[tuple[str | None, list[_Run]]] = []  # (lora name, its runs)
        batch_tokens = 0
        ghosts: list[int] = []
        run: _Run | None = None
        prev: int | None = None
        stack = list(reversed(children.get(None, ())))
        while stack:  # depth first, so that a chain continues one run of blocks
            h = stack.pop()
            block = self._blocks[h]
            if batches and batches[-1][0] == block.lora_name and batch_tokens < SNAPSHOT_BATCH_TOKENS:
                if prev == block.parent and run.block_size == block.block_size:
                    run.add(h, block)
                else:
                    run = _Run(h, block)
                    batches[-1][1].append(run)
            else:
                run = _Run(h, block)
                batches.append((block.lora_name, [run]))
                batch_tokens = 0
            batch_tokens += block.block_size
            prev = h
            if not block.live:
                ghosts.append(h)
            stack.extend(reversed(children.get(h, ())))
        out = [KvEventBatch(instance_id=instance_id, event_id=event_id, dp_rank=dp_rank, lora_name=lora,
                            events=[r.event() for r in runs]) for lora, runs in batches]
        if ghosts:
            out.append(KvEventBatch(instance_id=instance_id, event_id=event_id, dp_rank=dp_rank,
                                    events=[BlockRemoved(block_hashes=ghosts)]))
        by_tier: dict[str, list[int]] = {}
        for h, tier in self._own_tier.items():
            by_tier.setdefault(tier, []).append(h)
        if self._shared:
            by_tier["shared"] = list(self._shared)
        if by_tier:
            out.append(KvEventBatch(instance_id=instance_id, event_id=event_id, dp_rank=dp_rank, events=[
                BlockStored(block_hashes=hashes, parent_hash=None, tokens=b"", block_size=self._tier_block_size,
                            tier=tier) for tier, hashes in by_tier.items()]))
        return out


class _Run:
    """Consecutive blocks of a chain, for one BlockStored. Their tokens are kept as slices of
    the events' packed tokens (a chain stored by one event is one slice), joined once at the end."""

    __slots__ = ("hashes", "parent", "block_size", "pieces", "keys")

    def __init__(self, h: int, block: _Block):
        self.hashes = [h]
        self.parent = block.parent
        self.block_size = block.block_size
        self.pieces = [[block.tokens, block.offset, block.offset + 1]]  # [packed tokens, first block, end]
        self.keys = [block.media_key]

    def add(self, h: int, block: _Block) -> None:
        self.hashes.append(h)
        self.keys.append(block.media_key)
        last = self.pieces[-1]
        if last[0] is block.tokens and last[2] == block.offset:
            last[2] += 1
        else:
            self.pieces.append([block.tokens, block.offset, block.offset + 1])

    def event(self) -> BlockStored:
        step = self.block_size * 4
        tokens = b"".join(packed[first * step:end * step] for packed, first, end in self.pieces)
        return BlockStored(block_hashes=self.hashes, parent_hash=self.parent, tokens=tokens, block_size=self.block_size,
                           media_keys=self.keys if any(self.keys) else None)

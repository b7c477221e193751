"""KV cache events of one worker: which prefix blocks it holds. A KV-aware router mirrors
each worker's cache from them. Block hashes are the engine's own chained hashes (opaque ids:
a block's hash covers its parent's hash and its own token ids); only full blocks are stored."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1


class BlockStored(msgspec.Struct, tag="stored", omit_defaults=True, kw_only=True):
    """Consecutive full blocks of one sequence entered the prefix cache, in sequence order."""

    block_hashes: list[int]
    parent_hash: int | None  # hash of the block before the first one; None at sequence start
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    v: int = WIRE_VERSION


class BlockRemoved(msgspec.Struct, tag="removed", omit_defaults=True, kw_only=True):
    """Blocks were evicted from the prefix cache."""

    block_hashes: list[int]
    v: int = WIRE_VERSION


class AllBlocksCleared(msgspec.Struct, tag="cleared", omit_defaults=True, kw_only=True):
    """The whole prefix cache was dropped (clear_kv_blocks)."""

    v: int = WIRE_VERSION


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a worker publishes on the event plane: its events in order, numbered so that a
    subscriber can tell when it missed some (event_id grows by one per batch)."""

    instance_id: str
    event_id: int
    events: list[KvEvent]
    dp_rank: int = 0
    lora_name: str | None = None
    v: int = WIRE_VERSION


class KvReplayRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A router missed events of one publisher (one dp rank): everything after `after_event_id`,
    please (-1: from the start, e.g. a router that began following a worker late)."""

    after_event_id: int
    dp_rank: int = 0
    v: int = WIRE_VERSION


class KvReplayChunk(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One piece of the answer (large answers come as several chunks, all alike but `batches`).

    snapshot=False: `batches` are the missed batches themselves, in order, up to `event_id`.
    snapshot=True: they were no longer all buffered; `batches` describe the whole live cache as
    of `event_id` (BlockStored, parents before children, then BlockRemoved of blocks kept only
    to place their descendants): drop what you hold for this publisher and load these.
    Each batch is an encoded KvEventBatch (kept encoded on the worker, so sent as is).
    """

    snapshot: bool
    event_id: int  # the last event id this answer reflects (-1: none published yet)
    batches: list[msgspec.Raw] = msgspec.field(default_factory=list)
    v: int = WIRE_VERSION

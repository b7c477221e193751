"""KV cache events of one worker: which prefix blocks it holds. A KV-aware router mirrors
each worker's cache from them. Block hashes are the engine's own chained hashes (opaque ids:
a block's hash covers its parent's hash and its own token ids); only full blocks are stored.

Token ids travel packed: little-endian u32, 4 bytes each (`pack_token_ids`). msgspec decodes
them as one `bytes` object instead of a Python int per token, and the router hashes those bytes
as they are (turbine.router.hashing hashes a block as exactly these bytes).

Wire version 2: BlockStored carries `tokens` (packed bytes) instead of v1's `token_ids` (a list
of ints). A v2 decoder rejects a v1 BlockStored (its required `tokens` is missing) and a v1
decoder a v2 one, so mixed versions fail loudly instead of routing on wrong hashes.

Tiers (issue #18, still wire version 2): BlockStored and BlockRemoved have an optional `tier`.
None (omitted on the wire, so engine events are byte-for-byte what they were) is the engine's own
cache. A tier event is a worker's offload tiers (turbine.kvbm) speaking: `block_hashes` and
`parent_hash` are then the router's own hashes (the tiers name blocks by them), `tokens` is empty.
- "host", "disk": the worker's own tiers, consolidated: stored when a block first appears in one of
  them (and again, with the new tier, when its fastest tier changes), removed when gone from all;
- "shared": the shared tier the worker announces in its card (`kv_shared_tier`): stored when the
  worker put a block there or found one there, removed when it saw the block gone.
A router that predates tiers would take a tier event for an engine event; turbine's routers
handle both.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import msgspec

WIRE_VERSION = 2

_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    """Token ids as the wire carries them: little-endian u32, 4 bytes each. Raises OverflowError
    for an id outside 0..2**32-1 and TypeError for a non-int."""
    packed = array(_U32, token_ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """The inverse of pack_token_ids (ValueError if `data` is not a whole number of u32)."""
    packed = array(_U32)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


TIERS = ("host", "disk", "shared")  # fastest first; None: the engine's own cache


class BlockStored(msgspec.Struct, tag="stored", omit_defaults=True, kw_only=True):
    """Consecutive full blocks of one sequence entered the prefix cache, in sequence order."""

    block_hashes: list[int]
    parent_hash: int | None  # hash of the block before the first one; None at sequence start
    tokens: bytes  # the blocks' token ids, packed (pack_token_ids): len(block_hashes) * block_size * 4 bytes
    block_size: int
    # One per block: the media key (turbine.router.hashing.media_key) of the images whose placeholder tokens the
    # block holds, 0 for none; omitted when no block has one. The router mixes it into the block's hash.
    media_keys: list[int] | None = None
    tier: str | None = None  # None: the engine's cache; else one of TIERS (router hashes, no tokens: see above)
    v: int = WIRE_VERSION

    @classmethod
    def from_token_ids(cls, *, block_hashes: list[int], parent_hash: int | None, token_ids: Iterable[int],
                       block_size: int) -> BlockStored:
        """Build one from token ids as a list (packs them; OverflowError / TypeError as pack_token_ids)."""
        return cls(block_hashes=block_hashes, parent_hash=parent_hash, tokens=pack_token_ids(token_ids),
                   block_size=block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2

    @property
    def token_ids(self) -> list[int]:
        """The token ids unpacked (tests, debugging: the router never needs them as ints)."""
        return unpack_token_ids(self.tokens)


class BlockRemoved(msgspec.Struct, tag="removed", omit_defaults=True, kw_only=True):
    """Blocks were evicted from the prefix cache (`tier` set: from a worker's tiers, see above)."""

    block_hashes: list[int]
    tier: str | None = None
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

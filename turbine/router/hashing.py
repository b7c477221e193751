"""Engine-agnostic block identity.

The router hashes the token ids of each full block itself, so that routing never depends on
an engine's hash seed or algorithm. A block's hash chains its parent's hash, so one hash names
a whole prefix: two workers hold the same prefix exactly when they hold the same hash. The
seed is fixed (hashes are stable across processes and restarts) and salted by the LoRA name,
since the same tokens under another adapter are a different KV cache.
"""

from __future__ import annotations

import xxhash

from turbine.protocol.kv_events import pack_token_ids

BASE_SEED = 0x7475726269  # fixed: stable across processes, hosts and restarts
_U64 = (1 << 64) - 1
_h64 = xxhash.xxh3_64_intdigest


def seed_for(lora_name: str | None) -> int:
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + xxhash.xxh3_64_intdigest(lora_name.encode())) & _U64


def block_hashes(token_ids: list[int], block_size: int, *, lora_name: str | None = None,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is not
    hashed: engines cache only full blocks). `parent` continues a chain from an earlier block.

    Block i's hash is xxh3_64(seed, parent's hash as 8 little-endian bytes ++ the block's tokens
    as little-endian u32), the parent's bytes omitted for a chain's first block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids)
    full = n - n % block_size
    # One conversion of the whole prompt to the wire's packed form, then the packed path.
    return packed_block_hashes(pack_token_ids(token_ids if full == n else token_ids[:full]), block_size,
                               lora_name=lora_name, parent=parent)


def packed_block_hashes(tokens: bytes, block_size: int, *, lora_name: str | None = None,
                        parent: int | None = None) -> list[int]:
    """block_hashes over token ids already packed as little-endian u32 (what BlockStored.tokens
    carries): the same hashes, with no per-token work in Python. A trailing partial block (or
    stray bytes) is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    seed = BASE_SEED if not lora_name else seed_for(lora_name)
    step = block_size * 4
    end = len(tokens) - len(tokens) % step
    h64 = _h64
    out: list[int] = []
    append = out.append
    prev = parent
    start = 0
    if prev is None and end:
        prev = h64(tokens[:step], seed)  # one one-shot hash call per block, no hasher object
        append(prev)
        start = step
    for start in range(start, end, step):
        prev = h64(prev.to_bytes(8, "little") + tokens[start:start + step], seed)
        append(prev)
    return out

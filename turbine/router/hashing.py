"""Engine-agnostic block identity.

The router hashes the token ids of each full block itself, so that routing never depends on
an engine's hash seed or algorithm. A block's hash chains its parent's hash, so one hash names
a whole prefix: two workers hold the same prefix exactly when they hold the same hash. The
seed is fixed (hashes are stable across processes and restarts) and salted by the LoRA name,
since the same tokens under another adapter are a different KV cache.
"""

from __future__ import annotations

from array import array

import xxhash

BASE_SEED = 0x7475726269  # fixed: stable across processes, hosts and restarts
_U64 = (1 << 64) - 1


def seed_for(lora_name: str | None) -> int:
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + xxhash.xxh3_64_intdigest(lora_name.encode())) & _U64


def block_hashes(token_ids: list[int], block_size: int, *, lora_name: str | None = None,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is not
    hashed: engines cache only full blocks). `parent` continues a chain from an earlier block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    seed = seed_for(lora_name)
    full = len(token_ids) - len(token_ids) % block_size
    tokens = array("I", token_ids[:full]).tobytes()  # little-endian u32 on every host we run on
    step = block_size * 4
    out: list[int] = []
    prev = parent
    for start in range(0, len(tokens), step):
        h = xxhash.xxh3_64(seed=seed)
        if prev is not None:
            h.update(prev.to_bytes(8, "little"))
        h.update(tokens[start:start + step])
        prev = h.intdigest()
        out.append(prev)
    return out

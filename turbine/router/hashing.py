"""Engine-agnostic block identity.

The router hashes the token ids of each full block itself, so that routing never depends on
an engine's hash seed or algorithm. A block's hash chains its parent's hash, so one hash names
a whole prefix: two workers hold the same prefix exactly when they hold the same hash. The
seed is fixed (hashes are stable across processes and restarts) and salted by the LoRA name,
since the same tokens under another adapter are a different KV cache. A prompt's images key the
blocks from each image on (media_keyed_ids): the same text with another image is another prefix.
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


# Each image's key: its content hash as 4 pseudo token ids of 31 bits with the top bit set. No vocabulary
# reaches 2**31, so no prompt of real tokens (ids are checked against the vocabulary) spells a key.
_MEDIA_KEY_TOKENS = 4
_MEDIA_KEY_BIT = 1 << 31


def media_keyed_ids(token_ids: list[int], image_token_id: int | None, image_hashes: list[str]) -> list[int]:
    """The token ids for hashing a prompt that holds images (`image_hashes`: hex content hashes, in prompt
    order): each image's key follows its image token, so the blocks before the first image hash as plain
    text (a shared system prompt still matches) and every block from an image on depends on that image.
    With no known image token (or fewer of them than images), the keys go first: the whole prompt is keyed."""
    keys = []
    for h in image_hashes:
        value = int(h, 16)
        keys.append([_MEDIA_KEY_BIT | ((value >> (31 * k)) & (_MEDIA_KEY_BIT - 1)) for k in range(_MEDIA_KEY_TOKENS)])
    if not keys:
        return token_ids
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id] if image_token_id is not None else []
    if len(positions) < len(keys):
        return [t for key in keys for t in key] + list(token_ids)
    out: list[int] = []
    start = 0
    for pos, key in zip(positions, keys):
        out += token_ids[start:pos + 1]
        out += key
        start = pos + 1
    out += token_ids[start:]
    return out

"""Engine-agnostic block identity.

The router hashes the token ids of each full block itself, so that routing never depends on
an engine's hash seed or algorithm. A block's hash chains its parent's hash, so one hash names
a whole prefix: two workers hold the same prefix exactly when they hold the same hash. The
seed is fixed (hashes are stable across processes and restarts) and salted by the LoRA name,
since the same tokens under another adapter are a different KV cache.

Images: a block that holds any of an image's placeholder tokens in the engine's (widened) prompt
carries a media key (media_block_keys: the images' identifiers and their offsets in the block, as
vLLM keys its own block hashes), mixed into its hash. The frontend computes the keys from the
card's placeholder (widen_images); the worker's KV events relay them from vLLM's extra keys
(media_key), so both sides give an image block the same hash and two images never alias. Where the
engine's widening is not known to the frontend, media_keyed_ids keys the frontend's prompt instead.
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
                 parent: int | None = None, media_keys: list[int] | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is not
    hashed: engines cache only full blocks). `parent` continues a chain from an earlier block.

    Block i's hash is xxh3_64(seed, parent's hash as 8 little-endian bytes ++ the block's tokens
    as little-endian u32 ++ its media key as 8 little-endian bytes if it has one), the parent's bytes
    omitted for a chain's first block. `media_keys`: one per full block (0: none), media_block_keys'."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids)
    full = n - n % block_size
    # One conversion of the whole prompt to the wire's packed form, then the packed path.
    return packed_block_hashes(pack_token_ids(token_ids if full == n else token_ids[:full]), block_size,
                               lora_name=lora_name, parent=parent, media_keys=media_keys)


def packed_block_hashes(tokens: bytes, block_size: int, *, lora_name: str | None = None,
                        parent: int | None = None, media_keys: list[int] | None = None) -> list[int]:
    """block_hashes over token ids already packed as little-endian u32 (what BlockStored.tokens
    carries): the same hashes, with no per-token work in Python. A trailing partial block (or
    stray bytes) is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    seed = BASE_SEED if not lora_name else seed_for(lora_name)
    step = block_size * 4
    end = len(tokens) - len(tokens) % step
    if media_keys and any(media_keys):
        return _keyed_block_hashes(tokens[:end], step, seed, parent, media_keys)
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


def _keyed_block_hashes(tokens: bytes, step: int, seed: int, parent: int | None, keys: list[int]) -> list[int]:
    out: list[int] = []
    prev = parent
    for i, start in enumerate(range(0, len(tokens), step)):
        data = tokens[start:start + step]
        if prev is not None:
            data = prev.to_bytes(8, "little") + data
        key = keys[i] if i < len(keys) else 0
        if key:
            data += key.to_bytes(8, "little")
        prev = _h64(data, seed)
        out.append(prev)
    return out


def media_key(items: list[tuple[str, int]]) -> int:
    """One block's media key: the (identifier, offset) of each image whose placeholder the block overlaps, in
    prompt order, offset being where the placeholder starts relative to the block's first token (negative: in an
    earlier block). vLLM keys its block hashes by exactly these pairs ("mm" extra keys). 0: none (never a key)."""
    if not items:
        return 0
    return _h64("\x1f".join(f"{identifier}\x1e{offset}" for identifier, offset in items).encode()) or 1


def media_block_keys(ranges: list[tuple[int, int]], identifiers: list[str], num_tokens: int,
                     block_size: int) -> list[int]:
    """Each full block's media key (media_key) for a widened prompt of `num_tokens` tokens whose images take
    `ranges` ((offset, length) of each image's placeholder, in prompt order) under `identifiers`."""
    keys = []
    for start in range(0, num_tokens - num_tokens % block_size, block_size):
        end = start + block_size
        keys.append(media_key([(identifier, offset - start) for (offset, length), identifier
                               in zip(ranges, identifiers) if offset < end and offset + length > start]))
    return keys


def widen_images(token_ids: list[int], image_token_id: int, placeholder: list[int],
                 placeholder_range: tuple[int, int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The engine's prompt for `token_ids`: each image token replaced by the placeholder the engine gives an
    image (the card's, for models whose placeholder does not depend on the image), and each image's placeholder
    range (offset, length) in it; `placeholder_range` is the range's place within `placeholder`."""
    out: list[int] = []
    ranges: list[tuple[int, int]] = []
    start = 0
    for pos, token in enumerate(token_ids):
        if token == image_token_id:
            out += token_ids[start:pos]
            ranges.append((len(out) + placeholder_range[0], placeholder_range[1]))
            out += placeholder
            start = pos + 1
    out += token_ids[start:]
    return out, ranges


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

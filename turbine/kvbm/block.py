"""One KV block as the tiers hold it, and its file format (the disk and shared tiers).

A block is named by the router's chained hash (turbine.router.hashing): the hash already names
the model's adapter and the whole prefix, so two workers that hold the same hash hold the same KV.
Its payload is every layer's K and V for the block's tokens as one contiguous buffer; the tiers
never look inside it (the engine-side connector decides its layout).

File format, version 1 (little-endian), one file per block named `{hash:016x}.kvb`:

    offset size field
    0      4    magic b"TKVB"
    4      2    version (1)
    6      2    flags (bit 0: has a parent)
    8      8    block hash (u64; must match the file's name)
    16     8    parent hash (u64; 0 when there is none)
    24     4    token count (u32)
    28     8    payload length in bytes (u64)
    36     8    checksum: xxh3_64 of bytes 0..35 followed by the payload
    44     …    payload

A file whose size is not 44 + payload length (truncated, or grown), whose magic, version, name or
checksum disagree is corrupt: `decode` raises `CorruptBlock` and the caller drops the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

MAGIC = b"TKVB"
VERSION = 1
_FIELDS = struct.Struct("<4sHHQQIQ")  # everything the checksum covers before the payload
_CHECKSUM = struct.Struct("<Q")
HEADER_SIZE = _FIELDS.size + _CHECKSUM.size  # 44
_HAS_PARENT = 1
_U64 = (1 << 64) - 1
SUFFIX = ".kvb"


# Where a payload read from a file goes: a writable byte view of the given length, or None for bytes of its own.
ReadBuffer = Callable[[int], "memoryview | None"]


class CorruptBlock(ValueError):
    """A block file that must not be fed to the engine (the message says why)."""


@dataclass(frozen=True, slots=True)
class Block:
    block_hash: int
    parent_hash: int | None
    num_tokens: int
    # All layers' K/V of the block, one contiguous buffer: bytes, or a memoryview of bytes the caller keeps
    # alive and unchanged (the vLLM connector's pinned host memory on a GPU, which DMA copies read directly).
    data: bytes | memoryview

    def __post_init__(self):
        if not 0 <= self.block_hash <= _U64:
            raise ValueError(f"block_hash must be a u64, got {self.block_hash}")
        if self.parent_hash is not None and not 0 <= self.parent_hash <= _U64:
            raise ValueError(f"parent_hash must be a u64 or None, got {self.parent_hash}")
        if not 0 < self.num_tokens < 1 << 32:
            raise ValueError(f"num_tokens must be in 1..2^32-1, got {self.num_tokens}")
        if isinstance(self.data, memoryview):
            if not (self.data.c_contiguous and self.data.format == "B" and self.data.ndim == 1):
                raise ValueError("data: a memoryview must be one contiguous run of bytes (format 'B', 1-D)")
        elif not isinstance(self.data, bytes):
            raise TypeError(f"data must be bytes or a memoryview, got {type(self.data).__name__}")

    @property
    def nbytes(self) -> int:
        return len(self.data)  # for a 1-D byte memoryview too


def file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def hash_of_name(name: str) -> int | None:
    """The block hash a file name carries, None for anything else (temp files, strays)."""
    if len(name) != 16 + len(SUFFIX) or not name.endswith(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def header(block: Block) -> bytes:
    """The file's first HEADER_SIZE bytes (the payload, block.data, follows them)."""
    flags = _HAS_PARENT if block.parent_hash is not None else 0
    fields = _FIELDS.pack(MAGIC, VERSION, flags, block.block_hash, block.parent_hash or 0,
                          block.num_tokens, len(block.data))
    h = xxhash.xxh3_64(fields)
    h.update(block.data)
    return fields + _CHECKSUM.pack(h.intdigest())


def encode(block: Block) -> bytes:
    """The whole file as one buffer (a copy of the payload: the file tiers write header and payload apart)."""
    return b"".join((header(block), block.data))  # join takes memoryviews too


def decode(raw: bytes, expected_hash: int) -> Block:
    """The block in `raw` (its data a view of `raw`), or CorruptBlock naming what is wrong."""
    parent, num_tokens, _, checksum = _parsed_header(raw, expected_hash, len(raw))
    payload = memoryview(raw)[HEADER_SIZE:]  # a view, not a copy: a block is megabytes
    _verify(raw, payload, checksum)
    return _block(expected_hash, parent, num_tokens, payload)


def read_file(f: BinaryIO, expected_hash: int, buffer: ReadBuffer | None = None) -> Block:
    """The block in the open file `f` (unbuffered, at its start), checked as `decode` checks it. Its payload is
    read straight into `buffer(payload length)` where that gives a writable view of exactly that many bytes
    (the vLLM connector's pinned host slots on a GPU: no copy between the file and the DMA), else into bytes of
    its own."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(HEADER_SIZE) if size >= HEADER_SIZE else b""
    parent, num_tokens, length, checksum = _parsed_header(head, expected_hash, size)
    dest = buffer(length) if buffer is not None else None
    if dest is None:
        f.seek(0)
        return decode(f.read(), expected_hash)
    got = 0
    while got < length:
        n = f.readinto(dest[got:])
        if not n:
            raise CorruptBlock(f"{HEADER_SIZE + got} bytes, the header says {HEADER_SIZE + length} (shrank while read)")
        got += n
    _verify(head, dest, checksum)
    return _block(expected_hash, parent, num_tokens, dest)


def _parsed_header(raw: bytes, expected_hash: int, size: int) -> tuple[int | None, int, int, int]:
    """(parent, token count, payload length, checksum) from a file of `size` bytes that starts with `raw`."""
    if size < HEADER_SIZE or len(raw) < HEADER_SIZE:  # (a file cut short between its stat and its read)
        raise CorruptBlock(f"{min(size, len(raw))} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, block_hash, parent, num_tokens, length = _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptBlock(f"unknown version {version}")
    if block_hash != expected_hash:
        raise CorruptBlock(f"holds block {block_hash:016x}, not {expected_hash:016x}")
    if size != HEADER_SIZE + length:
        raise CorruptBlock(f"{size} bytes, the header says {HEADER_SIZE + length} (truncated or grown)")
    (checksum,) = _CHECKSUM.unpack_from(raw, _FIELDS.size)
    return (parent if flags & _HAS_PARENT else None), num_tokens, length, checksum


def _verify(head: bytes, payload, checksum: int) -> None:
    h = xxhash.xxh3_64(head[:_FIELDS.size])
    h.update(payload)
    if h.intdigest() != checksum:
        raise CorruptBlock("checksum mismatch")


def _block(block_hash: int, parent: int | None, num_tokens: int, payload) -> Block:
    try:
        return Block(block_hash, parent, num_tokens, payload)
    except ValueError as e:
        raise CorruptBlock(str(e)) from None

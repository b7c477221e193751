"""The file tiers: a worker's own local disk directory, and a directory several workers share.

Both write a block to a temp file of a unique name in the same directory and rename it into
place (atomic on POSIX), so a reader sees either no file or a whole one, however many writers
race; a reader still verifies the checksum (bit rot, a crash before the data reached the disk,
someone else's tool). No fsync: this is a cache, and a file a crash left short fails its check.

A write the filesystem refuses for lack of room (ENOSPC, EDQUOT, EFBIG) disables the tier's
writes with one warning: the worker goes on with fewer tiers, still reading what the tier holds.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from turbine.kvbm.block import (HEADER_SIZE, SUFFIX, Block, CorruptBlock, ReadBuffer, decode, file_name, hash_of_name,
                                header, read_file)
from turbine.kvbm.metrics import KvbmMetrics
from turbine.kvbm.store import BlockStore

log = logging.getLogger(__name__)

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0  # a shared tier's temp file this old is a crashed writer's: removed on a scan


def write_block_file(directory: str, block: Block, head: bytes | None = None) -> None:
    """The block's file in `directory`: its header (`head`, or computed here: the checksum runs outside the GIL),
    then the payload straight from the block's buffer, under a unique temp name renamed into place. Raises OSError
    (the temp file removed)."""
    tmp = os.path.join(directory, f".{block.block_hash:016x}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(header(block) if head is None else head)
            f.write(block.data)
        os.replace(tmp, os.path.join(directory, file_name(block.block_hash)))
    except OSError:
        _unlink(tmp)
        raise


# Writes a directory's block files: (directory, blocks) -> per block None or the OSError it met, in order.
WriteFiles = Callable[[str, "list[Block]"], "list[OSError | None]"]


def write_here(directory: str, blocks: list[Block]) -> list[OSError | None]:
    """WriteFiles in the calling thread, one file after another."""
    out: list[OSError | None] = []
    for block in blocks:
        try:
            write_block_file(directory, block)
            out.append(None)
        except OSError as e:
            out.append(e)
    return out


class _FileStore(BlockStore):
    def __init__(self, name: str, directory: str, capacity_bytes: int, metrics: KvbmMetrics | None):
        super().__init__(name, capacity_bytes)
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.metrics = metrics
        self._writable = True
        self._lock = threading.Lock()
        # Where a payload read from a file goes (the vLLM connector's pinned host slots on a GPU); None: bytes.
        self.read_buffer: ReadBuffer | None = None
        # Who writes a put_many's files (the vLLM connector's writer process on a GPU); None: the calling thread.
        self.write_files: WriteFiles | None = None

    @property
    def writable(self) -> bool:
        return self._writable

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.directory, file_name(block_hash))

    def _write_atomic(self, block: Block, head: bytes) -> bool:
        """The block's file, straight from the block's buffer (no copy of it); False (counted, logged) on failure."""
        try:
            write_block_file(self.directory, block, head)
            return True
        except OSError as e:
            self._write_failed(block.block_hash, e)
            return False

    def _write_failed(self, block_hash: int, e: OSError) -> None:
        if e.errno in FULL_ERRNOS:
            if self._writable:
                log.warning("KV %s tier at %s is full (%s): writes to it are off, the worker goes on "
                            "with the other tiers", self.name, self.directory, os.strerror(e.errno))
            self._writable = False
            if self.metrics:
                self.metrics.tier_disabled.labels(self.name).set(1)
        else:
            log.warning("KV %s tier: writing block %016x failed: %s", self.name, block_hash, e)
        if self.metrics:
            self.metrics.write_errors.labels(self.name).inc()

    def _read(self, block_hash: int) -> Block | None:
        """The verified block; None when absent; a corrupt file is unlinked and counted, then None."""
        path = self._path(block_hash)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        try:
            with f:
                return read_file(f, block_hash, self.read_buffer)
        except CorruptBlock as e:
            log.warning("KV %s tier: dropping corrupt block file %s: %s", self.name, path, e)
            _unlink(path)
            if self.metrics:
                self.metrics.corrupt.labels(self.name).inc()
            return None


class DiskStore(_FileStore):
    """A directory that only this worker writes, bounded by file bytes, least recently used out.
    What it holds survives a restart: the index is rebuilt from the files (oldest first by mtime)."""

    def __init__(self, directory: str, capacity_bytes: int, *, name: str = "disk",
                 metrics: KvbmMetrics | None = None):
        super().__init__(name, directory, capacity_bytes, metrics)
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, LRU order
        self._writing: set[int] = set()  # hashes being written (their bytes already counted in _used)
        self._used = 0
        found: list[tuple[float, int, int]] = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink(entry.path)  # ours, from a run that died mid-write
                    continue
                h = hash_of_name(entry.name)
                if h is not None and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self._used += size
        self._dropped(self._evict_to(0))

    def put(self, block: Block) -> bool:
        return self.put_many([block])[0]

    def put_many(self, blocks: list[Block]) -> list[bool]:
        """The blocks' files, written by `write_files` (set by the vLLM connector on a GPU: a process of its own,
        turbine/kvbm/file_writer.py), else here, one after another. In parts that fit the tier: a block being
        written cannot be evicted, so a part ends where the next block would need the room of one of its own."""
        held = [False] * len(blocks)
        start = 0
        while start < len(blocks):
            start = self._put_part(blocks, start, held)
        return held

    def _put_part(self, blocks: list[Block], start: int, held: list[bool]) -> int:
        """Reserves room for blocks[start:...] (as many as fit), writes them; returns where the next part starts."""
        todo: list[int] = []
        evicted: list[int] = []
        end = start
        with self._lock:
            for i in range(start, len(blocks)):
                block = blocks[i]
                size = HEADER_SIZE + block.nbytes
                if size > self.capacity_bytes or not self._writable:
                    end = i + 1
                    continue
                if block.block_hash in self._index or block.block_hash in self._writing:
                    if block.block_hash in self._index:
                        self._index.move_to_end(block.block_hash)
                    held[i] = True
                    end = i + 1
                    continue
                evicted += self._evict_to(size)
                if todo and self._used + size > self.capacity_bytes:
                    break  # the room is held by this part's own writes: the next part, once they are done
                # The room is taken now; the writes run outside the lock (reads of other blocks go on meanwhile).
                self._used += size
                self._writing.add(block.block_hash)
                todo.append(i)
                end = i + 1
        errors = (self.write_files or write_here)(self.directory, [blocks[i] for i in todo]) if todo else []
        with self._lock:
            for i, error in zip(todo, errors):
                block = blocks[i]
                self._writing.discard(block.block_hash)
                if error is None:
                    self._index[block.block_hash] = HEADER_SIZE + block.nbytes
                    held[i] = True
                else:
                    self._used -= HEADER_SIZE + block.nbytes
        for i, error in zip(todo, errors):
            if error is not None:
                self._write_failed(blocks[i].block_hash, error)
        self._dropped(evicted)
        return end

    def _evict_to(self, room: int) -> list[int]:
        """Unlinks least recently used files until `room` more bytes fit; the lock is held."""
        evicted = []
        while self._index and self._used + room > self.capacity_bytes:
            h, size = self._index.popitem(last=False)
            self._used -= size
            _unlink(self._path(h))
            evicted.append(h)
        return evicted

    def get(self, block_hash: int) -> Block | None:
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        block = self._read(block_hash)  # outside the lock: reads and writes of other blocks go on
        if block is not None:
            return block
        with self._lock:
            size = self._index.pop(block_hash, None)  # corrupt (unlinked) or gone
            if size is None:
                return None  # evicted meanwhile: whoever evicted it reported it
            self._used -= size
        self._dropped([block_hash])
        return None

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._index

    def held(self) -> list[int]:
        """Every block in the index, least recently used first (what a restart found, and since)."""
        with self._lock:
            return list(self._index)

    def remove(self, block_hash: int) -> bool:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is None:
                return False
            self._used -= size
            _unlink(self._path(block_hash))
            return True

    def used_bytes(self) -> int:
        return self._used


class SharedStore(_FileStore):
    """A directory several workers (processes, hosts on a shared filesystem) read and write.

    No worker owns an index: presence is the file itself. Recency is the file's mtime, touched on
    every hit, so eviction is least recently used across all workers. Each worker counts the
    bytes it wrote since its last scan of the directory and scans (then evicts oldest first) only
    when that estimate passes the capacity: the directory may overshoot by what the other workers
    wrote since their own last scans."""

    def __init__(self, directory: str, capacity_bytes: int, *, name: str = "shared",
                 metrics: KvbmMetrics | None = None):
        super().__init__(name, directory, capacity_bytes, metrics)
        self._estimate = 0
        self._dropped(self._scan_and_evict(0))

    def put(self, block: Block) -> bool:
        size = HEADER_SIZE + block.nbytes
        if size > self.capacity_bytes or not self._writable:
            return False
        path = self._path(block.block_hash)
        if _touch(path):
            return True  # another worker (or we) stored it already: same hash, same KV
        head = header(block)  # the checksum outside the lock
        evicted: list[int] = []
        with self._lock:
            if self._estimate + size > self.capacity_bytes:
                evicted = self._scan_and_evict(size)
            ok = self._write_atomic(block, head)
            if ok:
                self._estimate += size
        self._dropped(evicted)
        return ok

    def _scan_and_evict(self, room: int) -> list[int]:
        files: list[tuple[float, str, int, int | None]] = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # another worker removed it meanwhile
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(entry.path)
                    continue
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, entry.path, st.st_size, hash_of_name(entry.name)))
        used = sum(f[2] for f in files)
        evicted = []
        for _, path, size, h in sorted(files):
            if used + room <= self.capacity_bytes:
                break
            _unlink(path)
            used -= size
            if h is not None:
                evicted.append(h)
        self._estimate = used
        return evicted

    def get(self, block_hash: int) -> Block | None:
        path = self._path(block_hash)
        existed = os.path.exists(path)
        block = self._read(block_hash)
        if block is not None:
            _touch(path)
        elif existed:
            self._dropped([block_hash])  # corrupt, unlinked
        return block

    def contains(self, block_hash: int) -> bool:
        return os.path.exists(self._path(block_hash))

    def remove(self, block_hash: int) -> bool:
        return _unlink(self._path(block_hash))

    def used_bytes(self) -> int:
        """What the last scan found plus this worker's writes since (an estimate, see the class)."""
        return self._estimate


class FileCheck:
    """Checks block files for a process that does not own their tier (the vLLM connector's scheduler half,
    before it offers a block for loading): the file is whole and matches its name and checksum, as a
    tier's own read would check it; a bad file is unlinked (the caller counts it and tells the owner).

    A file verified once is not read again while it is unchanged: it is remembered by (device, inode,
    size, mtime), and every write of a block is a rename of a new file (a new inode), an edit in place
    moves the mtime. What this cannot see (bits that rot without a write) the owner's read still checks.

    A file the owner wrote itself is known good without a read (`remember`, with its `file_identity`)
    once its mtime is older than the filesystem clock's tick: an edit after that moves the mtime, while an edit in
    the tick of the write could keep it (git's "racily clean" files), so a file that recent is not remembered."""

    OK, MISSING, CORRUPT = "ok", "missing", "corrupt"

    def __init__(self, remembered: int = 1 << 16):
        self._known: OrderedDict[str, tuple[int, int, int, int]] = OrderedDict()  # path -> identity, LRU
        self._remembered = remembered
        self._lock = threading.Lock()  # callers may check from several threads

    def check(self, path: str, block_hash: int) -> str:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return self.MISSING
        with f:
            st = os.fstat(f.fileno())
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                if self._known.get(path) == identity:
                    self._known.move_to_end(path)
                    return self.OK
            raw = f.read()  # the read and the checksum outside the lock
        try:
            decode(raw, block_hash)
        except CorruptBlock as e:
            log.warning("KV tier: dropping corrupt block file %s (found before it was offered): %s", path, e)
            _unlink(path)
            with self._lock:
                self._known.pop(path, None)
            return self.CORRUPT
        self.remember(path, identity)
        return self.OK

    def remember(self, path: str, identity: tuple[int, int, int, int]) -> None:
        """`path` with this identity is good: not read again while it keeps it."""
        with self._lock:
            self._known[path] = identity
            self._known.move_to_end(path)
            if len(self._known) > self._remembered:
                self._known.popitem(last=False)


# Older than this, a file's mtime is past the filesystem clock's tick (1-10 ms on Linux): a later edit changes it.
SETTLED_NS = 50_000_000


def file_identity(path: str) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime in ns) of the file, as FileCheck remembers it; None when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def settled(identity: tuple[int, int, int, int]) -> bool:
    """Whether an edit of the file from now on would change this identity (see FileCheck)."""
    return time.time_ns() - identity[3] >= SETTLED_NS


TIER_ID_FILE = "tier-id"


def shared_tier_id(directory: str) -> str:
    """The id of the shared tier rooted at `directory`, the same for every worker that sees it however it
    is mounted: the first worker writes a random one to `directory/tier-id` (temp file + link, so one
    writer wins and nobody reads half of it), the others read it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TIER_ID_FILE)
    if not os.path.exists(path):
        tmp = os.path.join(directory, f".{TIER_ID_FILE}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(tmp, path)  # fails if another worker's is there already: theirs stands
        except FileExistsError:
            pass
        finally:
            _unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _touch(path: str) -> bool:
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False

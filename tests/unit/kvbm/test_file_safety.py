"""File tiers: a damaged file is dropped, never served; concurrent writers to the shared tier never
leave a torn block; a full filesystem turns the tier's writes off instead of failing the worker."""

import multiprocessing
import os
import resource
import signal
import threading
import time

import pytest

from turbine.kvbm import Block, DiskStore, KvbmMetrics, SharedStore, shared_tier_id
from turbine.kvbm.block import HEADER_SIZE
from turbine.kvbm.files import write_here

H = 0xC0FFEE


def corrupt_count(metrics, tier):
    return metrics.registry.get_sample_value("turbine_kvbm_corrupt_blocks_total", {"tier": tier}) or 0


@pytest.mark.parametrize("kind", ["disk", "shared"])
@pytest.mark.parametrize("damage", ["bitflip", "truncate", "empty"])
def test_damaged_file_is_dropped_not_served(kind, damage, tmp_path):
    m = KvbmMetrics()
    cls = DiskStore if kind == "disk" else SharedStore
    store = cls(str(tmp_path / kind), 1 << 20, metrics=m)
    dropped = []
    store.on_removed = lambda tier, h: dropped.append((tier, h))
    store.put(Block(H, 1, 16, b"k" * 4096))
    path = store._path(H)
    raw = bytearray(open(path, "rb").read())
    if damage == "bitflip":
        raw[HEADER_SIZE + 100] ^= 1
    elif damage == "truncate":
        raw = raw[: HEADER_SIZE + 2000]
    else:
        raw = b""
    with open(path, "wb") as f:
        f.write(raw)
    assert store.get(H) is None
    assert not os.path.exists(path) and not store.contains(H)
    assert corrupt_count(m, kind) == 1
    assert dropped == [(kind, H)]
    assert store.used_bytes() == 0 or kind == "shared"


# -- concurrent writers to the shared tier ---------------------------------------------------------
PAYLOAD = 256 * 1024  # large enough that a non-atomic write is seen half done


def _writer(directory: str, me: int, rounds: int, stop) -> None:
    """Rewrites the block at least `rounds` times, and on until `stop` is set (the readers are done)."""
    store = SharedStore(directory, 1 << 30)
    block = Block(H, None, 16, bytes([me]) * PAYLOAD)  # each writer its own bytes under one hash
    done = 0
    while done < rounds or not stop.is_set():
        store.remove(H)
        store.put(block)
        done += 1


def _reader(directory: str, seconds: float, out) -> None:
    """Reads for `seconds` from its own start (a loaded host may start it late), while the writers go on."""
    m = KvbmMetrics()
    store = SharedStore(directory, 1 << 30, metrics=m)
    seen = torn = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        b = store.get(H)
        if b is not None:
            seen += 1
            data = bytes(b.data)
            torn += len(data) != PAYLOAD or data.count(data[:1]) != PAYLOAD
    out.put((seen, torn, corrupt_count(m, "shared")))


@pytest.mark.parametrize("how", ["threads", "processes"])
def test_concurrent_writers_never_tear_a_block(how, tmp_path):
    directory = str(tmp_path / "shared")
    SharedStore(directory, 1 << 30)
    if how == "threads":
        import queue
        out, stop = queue.Queue(), threading.Event()
        workers = [threading.Thread(target=_writer, args=(directory, i + 1, 150, stop)) for i in range(3)]
        workers += [threading.Thread(target=_reader, args=(directory, 1.5, out)) for _ in range(2)]
    else:
        ctx = multiprocessing.get_context("fork")
        out, stop = ctx.Queue(), ctx.Event()
        workers = [ctx.Process(target=_writer, args=(directory, i + 1, 150, stop)) for i in range(3)]
        workers += [ctx.Process(target=_reader, args=(directory, 1.5, out)) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        results = [out.get(timeout=60) for _ in range(2)]
    finally:
        stop.set()  # the writers wrote all the while the readers read
    for w in workers:
        w.join(timeout=60)
    if how == "processes":
        assert all(w.exitcode == 0 for w in workers)
    assert sum(seen for seen, _, _ in results) > 0  # the readers did race the writers
    assert [(torn, corrupt) for _, torn, corrupt in results] == [(0, 0), (0, 0)]
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]  # no temp file left behind


# -- a full filesystem -----------------------------------------------------------------------------
def _fill(directory: str, out) -> None:
    """In a child: the kernel refuses files over 64 KiB (RLIMIT_FSIZE → EFBIG, like a quota)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    import logging
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("turbine.kvbm.files").addHandler(handler)
    m = KvbmMetrics()
    store = DiskStore(directory, 1 << 30, metrics=m)
    small, big, later = (Block(1, None, 16, b"s" * 1000), Block(2, 1, 16, b"b" * 100_000),
                         Block(3, 2, 16, b"l" * 1000))
    r = [store.put(small), store.put(big), store.writable, store.put(later), store.get(1) == small,
         store.contains(2), m.registry.get_sample_value("turbine_kvbm_tier_disabled", {"tier": "disk"}),
         m.registry.get_sample_value("turbine_kvbm_write_errors_total", {"tier": "disk"}),
         sorted(n for n in os.listdir(directory)), [w for w in warnings if "is full" in w]]
    out.put(r)


def test_full_disk_turns_the_tier_off_with_a_warning(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    directory = str(tmp_path / "disk")
    p = ctx.Process(target=_fill, args=(directory, out))
    p.start()
    r = out.get(timeout=60)
    p.join(timeout=60)
    *r, warnings = r
    # small stored; big refused by the filesystem; the tier stops writing (later refused without a try)
    # but still serves what it holds; the refused block left no file, not even a temp one
    assert r == [True, False, False, False, True, False, 1.0, 1.0, ["0000000000000001.kvb"]]
    assert len(warnings) == 1 and "writes to it are off" in warnings[0]


def _tier_id(directory: str, out) -> None:
    out.put(shared_tier_id(directory))


def test_every_worker_of_a_shared_directory_announces_the_same_tier_id(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tier_id, args=(str(tmp_path / "shared"), out)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(ids) == 1 and len(ids.pop()) == 32
    assert shared_tier_id(str(tmp_path / "shared")) == shared_tier_id(str(tmp_path / "shared"))
    assert shared_tier_id(str(tmp_path / "other")) != shared_tier_id(str(tmp_path / "shared"))
    assert not [n for n in os.listdir(tmp_path / "shared") if n.endswith(".tmp")]


# -- the disk tier's lock is not held over file I/O -----------------------------------------------------
def test_a_disk_read_does_not_wait_for_a_write_in_progress(tmp_path, monkeypatch):
    """On a GPU the loads of one step read many blocks while the writer thread writes others: a read must
    not queue behind a write (the tier's lock guards its index only)."""
    store = DiskStore(str(tmp_path / "disk"), 1 << 20)
    assert store.put(Block(0x1, None, 16, b"a" * 1000))
    entered, release = threading.Event(), threading.Event()

    def slow_write(directory, blocks):
        entered.set()
        release.wait(10)
        return write_here(directory, blocks)

    store.write_files = slow_write
    writer = threading.Thread(target=store.put, args=(Block(0x2, 0x1, 16, b"b" * 1000),))
    writer.start()
    assert entered.wait(5)
    started = time.monotonic()
    got = store.get(0x1)  # while 0x2 is being written
    assert got is not None and bytes(got.data) == b"a" * 1000 and time.monotonic() - started < 1.0
    assert store.get(0x2) is None and not store.contains(0x2)  # not there until written
    assert store.put(Block(0x2, 0x1, 16, b"b" * 1000))  # a second put of it while the first writes: no-op
    release.set()
    writer.join(5)
    assert bytes(store.get(0x2).data) == b"b" * 1000
    assert store.used_bytes() == 2 * (1000 + 44)

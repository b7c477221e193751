"""Each tier is bounded by bytes and drops its least recently used blocks first."""

import os

import pytest

from turbine.kvbm import Block, DiskStore, HostStore, SharedStore
from turbine.kvbm.block import HEADER_SIZE, file_name


def blk(h: int, size: int = 100) -> Block:
    return Block(h, None, 16, bytes([h % 256]) * size)


def make(kind, tmp_path, capacity):
    if kind == "host":
        return HostStore(capacity)
    if kind == "disk":
        return DiskStore(str(tmp_path / "disk"), capacity)
    return SharedStore(str(tmp_path / "shared"), capacity)


def per_block(kind):
    return 100 if kind == "host" else 100 + HEADER_SIZE


@pytest.mark.parametrize("kind", ["host", "disk", "shared"])
def test_lru_by_bytes(kind, tmp_path):
    store = make(kind, tmp_path, 3 * per_block(kind))
    dropped = []
    store.on_removed = lambda tier, h: dropped.append(h)
    for h in (1, 2, 3):
        assert store.put(blk(h))
    if kind == "shared":
        for h in (1, 2, 3):
            os.utime(store._path(h), (h, h))  # distinct mtimes: the shared tier's recency
    assert store.get(1) is not None  # 1 becomes the most recent: 2 is the oldest now
    assert store.put(blk(4))
    assert dropped == [2]
    assert not store.contains(2) and store.get(2) is None
    assert all(store.contains(h) for h in (1, 3, 4))
    assert store.used_bytes() == 3 * per_block(kind)
    # A larger block makes room for itself by evicting as many as it needs, oldest first.
    assert store.put(Block(5, None, 16, b"z" * (2 * per_block(kind) - (0 if kind == "host" else HEADER_SIZE))))
    assert dropped == [2, 3, 1]
    assert store.contains(4) and store.contains(5)


@pytest.mark.parametrize("kind", ["host", "disk", "shared"])
def test_block_larger_than_the_tier_is_refused(kind, tmp_path):
    store = make(kind, tmp_path, 50)
    assert not store.put(blk(1, 100))
    assert not store.contains(1)


def test_disk_index_survives_a_restart_and_drops_stale_temp_files(tmp_path):
    d = tmp_path / "disk"
    store = DiskStore(str(d), 10_000)
    store.put(blk(1))
    store.put(blk(2))
    (d / ".0000000000000003.999.dead.tmp").write_bytes(b"half a block")  # a writer that died
    again = DiskStore(str(d), 10_000)
    assert again.get(1) == blk(1) and again.get(2) == blk(2)
    assert again.used_bytes() == 2 * (100 + HEADER_SIZE)
    assert sorted(os.listdir(d)) == [file_name(1), file_name(2)]
    # A smaller capacity at restart evicts the oldest files to fit.
    os.utime(d / file_name(1), (1, 1))
    smaller = DiskStore(str(d), 100 + HEADER_SIZE)
    assert not smaller.contains(1) and smaller.contains(2)
    assert not (d / file_name(1)).exists()

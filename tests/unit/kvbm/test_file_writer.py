"""turbine/kvbm/file_writer.py: a disk tier's files written by a process of its own, from a memfd both processes
map: the files are the same a write here makes, nothing is written in this process while the writer lives, write
errors come back per block, and a dead writer process leaves the writes to this process."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from turbine.kvbm import Block, DiskStore, TieredStore
from turbine.kvbm import files as kvbm_files
from turbine.kvbm.block import file_name, read_file
from turbine.kvbm.file_writer import ProcessFileWriter

SLOT = 4096
SLOTS = 8


@pytest.fixture
def buffer():
    """A memfd of SLOTS slots, each filled with its own byte, and offset_of for views of it."""
    fd = os.memfd_create("test-kvbm-slots")
    os.ftruncate(fd, SLOT * SLOTS)
    mm = mmap.mmap(fd, SLOT * SLOTS)
    for i in range(SLOTS):
        mm[i * SLOT:(i + 1) * SLOT] = bytes([i + 1]) * SLOT
    view = memoryview(mm)
    views = [view[i * SLOT:(i + 1) * SLOT] for i in range(SLOTS)]

    def offset_of(data):
        for i, v in enumerate(views):
            if data is v:
                return i * SLOT
        return None
    yield fd, views, offset_of
    for v in views:
        v.release()
    view.release()
    mm.close()
    os.close(fd)


def _read(directory, block_hash):
    with open(os.path.join(directory, file_name(block_hash)), "rb") as f:
        return read_file(f, block_hash)


def test_the_writer_process_writes_the_files_this_process_would(tmp_path, buffer, monkeypatch):
    fd, views, offset_of = buffer
    writer = ProcessFileWriter(fd, SLOT * SLOTS, offset_of, threads=2)
    try:
        disk = DiskStore(str(tmp_path / "disk"), 1 << 20)
        disk.write_files = writer.write

        def not_here(*a, **kw):
            raise AssertionError("a file was written in the engine's process")
        monkeypatch.setattr(kvbm_files, "write_block_file", not_here)
        blocks = [Block(0x100 + i, 0x100 + i - 1 if i else None, 16, views[i]) for i in range(5)]
        assert TieredStore([disk]).put_many(blocks) == [["disk"]] * 5
        monkeypatch.undo()
        for i in range(5):
            got = _read(disk.directory, 0x100 + i)
            assert bytes(got.data) == bytes([i + 1]) * SLOT and got.parent_hash == (0x100 + i - 1 if i else None)
            assert bytes(disk.get(0x100 + i).data) == bytes([i + 1]) * SLOT
        assert disk.used_bytes() == 5 * (SLOT + 44)
        # A payload outside the buffer (bytes of its own) is written here, beside the others.
        mixed = [Block(0x200, None, 16, views[5]), Block(0x201, None, 16, b"z" * SLOT)]
        assert disk.put_many(mixed) == [True, True]
        assert bytes(_read(disk.directory, 0x201).data) == b"z" * SLOT
        assert writer.alive
    finally:
        writer.close()
    assert not writer.alive


def test_write_errors_come_back_per_block(tmp_path, buffer):
    fd, views, offset_of = buffer
    writer = ProcessFileWriter(fd, SLOT * SLOTS, offset_of)
    try:
        errors = writer.write(str(tmp_path / "missing"), [Block(0x1, None, 16, views[0])])
        assert isinstance(errors[0], OSError) and errors[0].errno == errno.ENOENT
        assert writer.write(str(tmp_path), [Block(0x2, None, 16, views[1])]) == [None]
        assert bytes(_read(str(tmp_path), 0x2).data) == bytes([2]) * SLOT
    finally:
        writer.close()


def test_a_dead_writer_process_leaves_the_writes_to_this_process(tmp_path, buffer):
    fd, views, offset_of = buffer
    writer = ProcessFileWriter(fd, SLOT * SLOTS, offset_of)
    disk = DiskStore(str(tmp_path / "disk"), 1 << 20)
    disk.write_files = writer.write
    assert disk.put(Block(0x1, None, 16, views[0]))
    writer._proc.kill()
    writer._proc.wait()
    assert disk.put_many([Block(0x2, None, 16, views[1]), Block(0x3, None, 16, views[2])]) == [True, True]
    assert not writer.alive
    for h, byte in ((0x1, 1), (0x2, 2), (0x3, 3)):
        assert bytes(disk.get(h).data) == bytes([byte]) * SLOT
    writer.close()


def test_a_full_u64_hash_and_parent_cross_the_pipe_intact(tmp_path, buffer):
    fd, views, offset_of = buffer
    writer = ProcessFileWriter(fd, SLOT * SLOTS, offset_of)
    top = (1 << 64) - 1
    try:
        assert writer.write(str(tmp_path), [Block(top, top - 1, 16, views[3])]) == [None]
        got = _read(str(tmp_path), top)
        assert got.block_hash == top and got.parent_hash == top - 1 and bytes(got.data) == bytes([4]) * SLOT
    finally:
        writer.close()


def test_a_line_that_is_not_a_batch_ends_the_writer_process_and_this_process_writes_on(tmp_path, buffer):
    fd, views, offset_of = buffer
    writer = ProcessFileWriter(fd, SLOT * SLOTS, offset_of)
    writer._proc.stdin.write(b'["not", "a batch"]\n')
    writer._proc.stdin.flush()
    assert writer._proc.wait(10) != 0
    assert writer.write(str(tmp_path), [Block(0x5, None, 16, views[4])]) == [None]
    assert bytes(_read(str(tmp_path), 0x5).data) == bytes([5]) * SLOT and not writer.alive
    writer.close()

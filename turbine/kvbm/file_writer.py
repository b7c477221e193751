"""Block files written by a process of their own, from a memory buffer both processes map.

Why a process: on a GPU the engine's own thread launches the model's kernels from Python, and threads of the
engine's process that write files take the GIL back after every system call. Measured on an H200 (2026-11-30,
docs/benchmarks/gpu.md): 4 writer threads in the engine process made 16k-token first turns 16-26 % slower, 8
threads 36 %; the same writes at 3.6-5.3 GB/s from another process cost those turns nothing. So the writes
(checksum, temp file, rename) run here, on threads of this process, and the engine's process sends one line per
batch and waits for one line back.

The payloads are not sent: they live in a buffer of the engine process's (the vLLM connector's host slots) that is
a memfd both processes map (a memfd rather than /dev/shm: a container's /dev/shm is often 64 MB). A job names the
payload by its offset in that buffer; the engine keeps the payload unchanged until the batch's answer is back.
Only JSON of typed structs crosses the pipe (msgspec; nothing is unpickled), one line each way per batch:

  parent → child: WriteBatch [directory, [WriteJob [hash, parent hash or null, tokens, offset, bytes], ...]]
  child → parent: [errno or 0, ...]  (one per job, in order)

`ProcessFileWriter(...).write` is a `WriteFiles` (turbine/kvbm/files.py): a DiskStore's `write_files`. A block whose
payload is not in the buffer is written in the calling thread; if the process dies, every later write is.
"""

from __future__ import annotations

import argparse
import errno
import logging
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from turbine.kvbm.block import Block
from turbine.kvbm.files import write_block_file, write_here

log = logging.getLogger(__name__)

# The offset of a payload in the shared buffer, None when it is not in it.
OffsetOf = Callable[[object], "int | None"]


class WriteJob(msgspec.Struct, array_like=True, frozen=True):
    """One block's file: the block's fields, and where its payload is in the shared buffer."""
    block_hash: int
    parent_hash: int | None
    num_tokens: int
    offset: int
    nbytes: int


class WriteBatch(msgspec.Struct, array_like=True, frozen=True):
    directory: str
    jobs: list[WriteJob]


_ENCODE = msgspec.json.Encoder().encode
_DECODE_BATCH = msgspec.json.Decoder(WriteBatch).decode
_DECODE_ERRNOS = msgspec.json.Decoder(list[int]).decode


class ProcessFileWriter:
    """The parent's side: starts the writer process on `fd` (a memfd of `size` bytes, the buffer the payloads live
    in), writes batches through it. Thread-safe (one batch at a time)."""

    def __init__(self, fd: int, size: int, offset_of: OffsetOf, threads: int = 4):
        self._offset_of = offset_of
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "turbine.kvbm.file_writer", "--fd", str(fd), "--size", str(size),
             "--threads", str(threads)],
            # its own session: a Ctrl-C meant for the engine does not reach it; it ends when its input does
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), close_fds=True, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def write(self, directory: str, blocks: list[Block]) -> list[OSError | None]:
        offsets = [self._offset_of(b.data) for b in blocks]
        remote = [i for i, off in enumerate(offsets) if off is not None]
        out: list[OSError | None] = [None] * len(blocks)
        if remote:
            errnos = self._exchange(WriteBatch(directory, [
                WriteJob(blocks[i].block_hash, blocks[i].parent_hash, blocks[i].num_tokens, offsets[i], blocks[i].nbytes)
                for i in remote]))
            if errnos is None:  # the process is gone: these are written here
                local = remote + [i for i, off in enumerate(offsets) if off is None]
            else:
                for i, err in zip(remote, errnos):
                    out[i] = OSError(err, os.strerror(err)) if err else None
                local = [i for i, off in enumerate(offsets) if off is None]
        else:
            local = list(range(len(blocks)))
        for i, err in zip(local, write_here(directory, [blocks[i] for i in local])):
            out[i] = err
        return out

    def _exchange(self, batch: WriteBatch) -> list[int] | None:
        with self._lock:
            if not self.alive:
                return None
            try:
                self._proc.stdin.write(_ENCODE(batch) + b"\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
                errnos = _DECODE_ERRNOS(line) if line else None
                why = "no answer" if errnos is None else None
            except (OSError, msgspec.DecodeError) as e:
                errnos, why = None, str(e)
            if errnos is None or len(errnos) != len(batch.jobs):
                if self._proc.poll() is None:
                    self._proc.kill()
                log.error("kvbm: the file writer process stopped (%s, exit %s): files are written in this process now",
                          why or f"{len(errnos)} answers to {len(batch.jobs)} jobs", self._proc.wait())
                self._proc = None
                return None
            return errnos

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._proc is None:
                return
            try:
                self._proc.stdin.close()  # the child's end of input: it finishes and exits
                self._proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def _serve(fd: int, size: int, threads: int) -> int:
    buf = memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    os.close(fd)  # the mapping keeps the memory

    def write(directory: str, job: WriteJob) -> int:
        try:
            payload = buf[job.offset:job.offset + job.nbytes]
            write_block_file(directory, Block(job.block_hash, job.parent_hash, job.num_tokens, payload))
            return 0
        except OSError as e:
            return e.errno or errno.EIO
        except ValueError:  # not a block (the parent sends only blocks it built: a bug, reported, not fatal)
            return errno.EINVAL
    with ThreadPoolExecutor(threads, thread_name_prefix="kvbm-file") as pool:
        for line in sys.stdin.buffer:
            batch = _DECODE_BATCH(line)  # a line that is not a batch ends the process: the parent writes on alone
            errnos = list(pool.map(lambda job: write(batch.directory, job), batch.jobs))
            sys.stdout.buffer.write(_ENCODE(errnos) + b"\n")
            sys.stdout.buffer.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the KV tiers' file writer process (started by ProcessFileWriter)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args(argv)
    return _serve(a.fd, a.size, a.threads)


if __name__ == "__main__":
    raise SystemExit(main())

"""Discovery in a shared directory: no service to run (one host, or a shared filesystem).

Layout under `root_dir`:
  leases/<lease_id>/heartbeat    JSON `Heartbeat`, rewritten every ttl/3 by its owner (on a thread of its own)
  leases/<lease_id>/k.<key>      one file per key (key percent-escaped), content = value
  staging/                       lease dirs being created or reaped (moved atomically)

Files are written to a temp name and os.replace()d, so readers never see partial values.
A lease is dead when its heartbeat is older than its ttl, or when its pid is gone on this
host, or a zombie (so a SIGKILLed process vanishes at the next poll); readers remove dead leases, and an
owner whose lease was reaped (starved past its TTL) builds it again with every key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote, unquote

import msgspec

from turbine.runtime.discovery.base import DiscoveryBackend

logger = logging.getLogger("turbine.discovery")

_HEARTBEAT = "heartbeat"
_KEY_PREFIX = "k."
_TMP_PREFIX = ".tmp."


class Heartbeat(msgspec.Struct, kw_only=True):
    pid: int
    hostname: str
    # PID namespace of the owner: a pid is only checked where it means the same process
    # (containers may share a hostname and a directory but not their pids).
    pid_namespace: str
    time: float  # time.time() of the last refresh
    ttl: float


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    # A killed process that its parent has not reaped yet (a zombie) still answers kill(0); it serves
    # nothing, so its lease goes now rather than a TTL later.
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def _key_file(key: str) -> str:
    name = _KEY_PREFIX + quote(key, safe="")
    if len(name.encode()) > 255:
        raise ValueError(f"discovery key too long for a file name: {key!r}")
    return name


class FileDiscovery(DiscoveryBackend):
    def __init__(self, root_dir: str | os.PathLike[str], ttl: float = 10.0, poll_interval: float = 0.25) -> None:
        self.root = Path(root_dir)
        self.ttl = ttl
        self.poll_interval = poll_interval
        self.lease_id = uuid.uuid4().hex
        self._leases = self.root / "leases"
        self._staging = self.root / "staging"
        self._dir = self._leases / self.lease_id
        self._keys: dict[str, bytes] = {}  # what we own: the truth that _rebuild() restores
        self._hostname = socket.gethostname()
        self._pid_namespace = _pid_namespace()
        self._task: asyncio.Task[None] | None = None
        self._heartbeats: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._leases.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(parents=True, exist_ok=True)
        self._rebuild()
        self._heartbeats = ThreadPoolExecutor(1, thread_name_prefix="discovery-heartbeat")
        self._task = asyncio.create_task(self._heartbeat_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._heartbeats is not None:
            self._heartbeats.shutdown(wait=False)
            self._heartbeats = None
        self._remove(self._dir)
        self._keys.clear()

    async def put(self, key: str, value: bytes) -> None:
        name = _key_file(key)
        self._keys[key] = value
        try:
            self._write(self._dir / name, value)
        except FileNotFoundError:  # our lease dir was reaped: rebuild all of it
            self._rebuild()

    async def delete(self, key: str) -> None:
        if self._keys.pop(key, None) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / _key_file(key))

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return await asyncio.to_thread(self._scan, prefix)

    async def watch_prefix(self, prefix: str) -> AsyncIterator[dict[str, bytes]]:
        last: dict[str, bytes] | None = None
        while True:
            snapshot = await asyncio.to_thread(self._scan, prefix)
            if snapshot != last:
                last = snapshot
                yield snapshot
            await asyncio.sleep(self.poll_interval)

    # ------------------------------------------------------------ owner side

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                # In a thread: where the filesystem is busy writing back (a disk KV tier, say) even a small
                # write can wait seconds, and the owner's event loop (a worker serving) must not wait with it.
                # A thread of its own: in the loop's shared pool it could queue behind long jobs (image encodes).
                if not await asyncio.get_running_loop().run_in_executor(self._heartbeats, self._refresh_heartbeat):
                    # A reader reaped the lease (we were starved past the TTL): it comes back whole.
                    logger.warning("discovery lease %s was reaped: re-registering its %d key(s)", self.lease_id,
                                   len(self._keys))
                    self._rebuild()
            except OSError:
                logger.warning("discovery heartbeat in %s failed", self._dir, exc_info=True)

    def _heartbeat(self) -> bytes:
        return msgspec.json.encode(Heartbeat(pid=os.getpid(), hostname=self._hostname,
                                             pid_namespace=self._pid_namespace, time=time.time(), ttl=self.ttl))

    def _refresh_heartbeat(self) -> bool:
        """False when our lease dir is gone (reaped by a reader)."""
        try:
            self._write(self._dir / _HEARTBEAT, self._heartbeat())
        except FileNotFoundError:
            return False
        return True

    def _rebuild(self) -> None:
        """Our lease dir with its heartbeat and every key we own, unless it is there. Built aside then moved in,
        so readers see the lease whole or not at all (never a heartbeat whose keys are still being written)."""
        if self._dir.is_dir():
            return
        tmp = self._staging / f"{self.lease_id}.{uuid.uuid4().hex}"
        tmp.mkdir()
        for key, value in self._keys.items():
            self._write(tmp / _key_file(key), value)
        self._write(tmp / _HEARTBEAT, self._heartbeat())
        os.rename(tmp, self._dir)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        try:
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # ------------------------------------------------------------ reader side (worker thread)

    def _scan(self, prefix: str) -> dict[str, bytes]:
        result: dict[str, bytes] = {}
        try:
            leases = sorted(os.listdir(self._leases))
        except FileNotFoundError:
            return result
        now = time.time()
        for lease in leases:
            lease_dir = self._leases / lease
            # Our own lease is never judged here: our heartbeat loop heals it.
            if lease != self.lease_id and not self._alive(lease_dir, now):
                self._remove(lease_dir)
                continue
            try:
                names = os.listdir(lease_dir)
            except FileNotFoundError:
                continue
            for name in names:
                if not name.startswith(_KEY_PREFIX):
                    continue
                key = unquote(name[len(_KEY_PREFIX) :])
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        result[key] = (lease_dir / name).read_bytes()
        return result

    def _alive(self, lease_dir: Path, now: float) -> bool:
        try:
            hb = msgspec.json.decode((lease_dir / _HEARTBEAT).read_bytes(), type=Heartbeat)
        except (FileNotFoundError, msgspec.DecodeError):
            # Heartbeats are written atomically, so this is a half-removed or foreign dir.
            try:
                return now - lease_dir.stat().st_mtime <= self.ttl
            except FileNotFoundError:
                return False
        if now - hb.time > hb.ttl:
            return False
        same_pids = hb.hostname == self._hostname and hb.pid_namespace == self._pid_namespace
        return not same_pids or _pid_alive(hb.pid)

    def _remove(self, lease_dir: Path) -> None:
        # Moved aside first so readers see the whole lease vanish at once.
        grave = self._staging / f"dead.{uuid.uuid4().hex}"
        try:
            os.rename(lease_dir, grave)
        except OSError:
            return  # already gone (another reader reaped it)
        shutil.rmtree(grave, ignore_errors=True)
        if lease_dir != self._dir:
            logger.info("removed dead discovery lease %s", lease_dir.name)

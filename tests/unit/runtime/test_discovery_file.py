import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest

from turbine.runtime.discovery import make_backend
from turbine.runtime.discovery.file import FileDiscovery, Heartbeat

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHILD = """
import asyncio, sys
from turbine.runtime.discovery.file import FileDiscovery

async def main():
    d = FileDiscovery(sys.argv[1], ttl=float(sys.argv[2]))
    await d.start()
    await d.put("workers/child", b"alive")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
async def open_backends(tmp_path):
    """Factory of started FileDiscovery backends, closed at teardown."""
    made: list[FileDiscovery] = []

    async def make(root: Path = tmp_path / "disc", ttl: float = 2.0) -> FileDiscovery:
        backend = FileDiscovery(root, ttl=ttl, poll_interval=0.05)
        await backend.start()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


async def eventually(predicate, timeout: float = 5.0) -> float:
    """Wait until the async `predicate()` is true; returns the seconds it took."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_put_get_delete_across_processes_view(open_backends):
    owner, reader = await open_backends(), await open_backends()
    await owner.put("instances/ns/c/e/1", b"one")
    await owner.put("instances/ns/c/e/2", b"two")
    await owner.put("weird key/%2F/../\u00e9", b"odd")
    await owner.put("models/ns/c/e/1", b"card")
    assert await reader.get_prefix("instances/") == {"instances/ns/c/e/1": b"one", "instances/ns/c/e/2": b"two"}
    assert await reader.get_prefix("weird") == {"weird key/%2F/../\u00e9": b"odd"}
    assert len(await reader.get_prefix("")) == 4

    await owner.put("instances/ns/c/e/1", b"uno")  # replace
    await owner.delete("instances/ns/c/e/2")
    await owner.delete("never/existed")
    assert await reader.get_prefix("instances/") == {"instances/ns/c/e/1": b"uno"}


async def test_close_removes_keys_at_once(open_backends, tmp_path):
    owner, reader = await open_backends(), await open_backends()
    await owner.put("k", b"v")
    await owner.close()
    assert await reader.get_prefix("") == {}


async def test_watch_yields_snapshot_then_each_change(open_backends):
    owner, reader = await open_backends(), await open_backends()
    await owner.put("x/1", b"a")
    watch = reader.watch_prefix("x/")
    async with asyncio.timeout(5):
        assert await anext(watch) == {"x/1": b"a"}
        await owner.put("x/2", b"b")
        await owner.put("y/ignored", b"-")
        assert await anext(watch) == {"x/1": b"a", "x/2": b"b"}
        await owner.delete("x/1")
        assert await anext(watch) == {"x/2": b"b"}
    await watch.aclose()


async def test_separate_roots_do_not_see_each_other(open_backends, tmp_path):
    a = await open_backends(tmp_path / "a")
    b = await open_backends(tmp_path / "b")
    await a.put("k", b"from-a")
    await b.put("k", b"from-b")
    assert await a.get_prefix("") == {"k": b"from-a"}
    assert await b.get_prefix("") == {"k": b"from-b"}


async def test_sigkilled_process_disappears_fast_by_pid_check(open_backends, tmp_path, python_child):
    root = tmp_path / "disc"
    reader = await open_backends(root)
    # A long TTL: only the pid check can make it vanish within the test's bound.
    proc, line = await python_child(CHILD, root, 60)
    assert line == "ready"
    assert await reader.get_prefix("workers/") == {"workers/child": b"alive"}
    proc.kill()
    proc.wait()
    took = await eventually(lambda: _empty(reader, "workers/"), timeout=3)
    assert took < 2
    assert os.listdir(root / "leases") == [reader.lease_id]  # the dead lease was reaped


async def test_killed_process_not_yet_reaped_by_its_parent_disappears_by_pid_check(open_backends, tmp_path,
                                                                                  python_child):
    """A zombie still answers kill(pid, 0): it is dead all the same, long before its TTL."""
    root = tmp_path / "disc"
    reader = await open_backends(root)
    proc, line = await python_child(CHILD, root, 60)
    assert line == "ready"
    proc.kill()  # not waited for: a zombie until the fixture reaps it
    await eventually(lambda: _empty(reader, "workers/"), timeout=3)
    assert proc.poll() is not None  # (and it was a zombie all along: only now reaped)


async def test_a_slow_heartbeat_write_does_not_stall_the_owners_event_loop(open_backends, tmp_path, monkeypatch):
    """The heartbeat is written in a thread: the owner's loop runs while the write waits (as on a filesystem
    busy writing back), and the write goes through once the filesystem answers."""
    owner = await open_backends(ttl=0.3)
    released, waited = threading.Event(), []
    write = FileDiscovery._write

    def slow_write(path, data):
        if path.name == "heartbeat":
            waited.append(released.wait(timeout=5))  # in the loop's thread this would block the loop 5 s
        write(path, data)

    monkeypatch.setattr(FileDiscovery, "_write", staticmethod(slow_write))
    for _ in range(10):  # the loop goes on turning while the heartbeat write waits
        await asyncio.sleep(0.05)
    released.set()
    await eventually(lambda: asyncio.sleep(0, bool(waited)), timeout=3)
    assert waited[0] is True  # released by this loop, not by its timeout
    monkeypatch.undo()
    await owner.put("a", b"1")
    assert await owner.get_prefix("") == {"a": b"1"}


async def test_the_heartbeat_does_not_queue_behind_the_loops_shared_threads(open_backends, tmp_path):
    """Every thread of the loop's shared pool busy (long jobs: image encodes, say): the heartbeat, on a thread
    of its own, still goes on."""
    owner = await open_backends(ttl=0.3)  # a heartbeat every 0.1 s
    heartbeat = tmp_path / "disc" / "leases" / owner.lease_id / "heartbeat"
    released = threading.Event()
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(None, released.wait, 10) for _ in range(40)]  # more than the pool's threads
    try:
        seen = msgspec.json.decode(heartbeat.read_bytes(), type=Heartbeat).time
        await eventually(lambda: asyncio.sleep(0, msgspec.json.decode(heartbeat.read_bytes(), type=Heartbeat).time
                                               > seen + 0.25), timeout=3)
    finally:
        released.set()
        await asyncio.gather(*jobs)


async def test_starved_process_vanishes_then_reregisters_without_restart(open_backends, tmp_path, python_child):
    root = tmp_path / "disc"
    reader = await open_backends(root)
    proc, line = await python_child(CHILD, root, 1.0)
    assert line == "ready"
    assert await reader.get_prefix("workers/") == {"workers/child": b"alive"}
    os.kill(proc.pid, signal.SIGSTOP)  # alive (pid exists) but not heartbeating
    await eventually(lambda: _empty(reader, "workers/"), timeout=4)
    os.kill(proc.pid, signal.SIGCONT)
    await eventually(lambda: _has(reader, "workers/child"), timeout=3)


async def test_owner_rebuilds_reaped_lease_dir(open_backends, tmp_path):
    owner = await open_backends(ttl=0.6)  # heartbeat every 0.2 s
    reader = await open_backends()
    await owner.put("a", b"1")
    await owner.put("b", b"2")
    shutil.rmtree(tmp_path / "disc" / "leases" / owner.lease_id)
    assert await reader.get_prefix("") == {}
    await eventually(lambda: _equals(reader, {"a": b"1", "b": b"2"}), timeout=3)


async def test_aged_heartbeat_hides_lease_until_owner_heals_it(open_backends, tmp_path):
    owner = await open_backends(ttl=0.9)
    reader = await open_backends()
    await owner.put("a", b"1")
    heartbeat = tmp_path / "disc" / "leases" / owner.lease_id / "heartbeat"
    hb = msgspec.json.decode(heartbeat.read_bytes(), type=Heartbeat)
    hb.time -= 100  # as if the owner had been starved for 100 s
    heartbeat.write_bytes(msgspec.json.encode(hb))
    assert await reader.get_prefix("") == {}  # dead to readers, and reaped
    assert not (tmp_path / "disc" / "leases" / owner.lease_id).exists()
    await eventually(lambda: _equals(reader, {"a": b"1"}), timeout=3)


async def test_put_after_lease_dir_vanished_rebuilds_everything(open_backends, tmp_path):
    owner, reader = await open_backends(ttl=60), await open_backends()
    await owner.put("a", b"1")
    shutil.rmtree(tmp_path / "disc" / "leases" / owner.lease_id)
    await owner.put("b", b"2")  # long before the next heartbeat
    assert await reader.get_prefix("") == {"a": b"1", "b": b"2"}


async def test_make_backend(tmp_path):
    backend = make_backend("file", etcd_endpoints=None, file_dir=str(tmp_path), ttl=5)
    assert isinstance(backend, FileDiscovery) and backend.root == tmp_path and backend.ttl == 5
    with pytest.raises(ValueError, match="--discovery-backend"):
        make_backend("zookeeper", etcd_endpoints=None, file_dir=None, ttl=5)


async def _empty(backend, prefix):
    return await backend.get_prefix(prefix) == {}


async def _has(backend, key):
    return key in await backend.get_prefix("")


async def _equals(backend, expected):
    return await backend.get_prefix("") == expected

"""EtcdDiscovery against a real etcd (see the etcd_endpoint fixture in tests/conftest.py)."""

import asyncio
import os
import signal
import time
import uuid

import pytest
from etcd3aio import Etcd3Client

from turbine.runtime.discovery import make_backend
from turbine.runtime.discovery.etcd import EtcdDiscovery
from turbine.runtime.errors import DiscoveryError
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

TTL = 2

CHILD = """
import asyncio, sys
from turbine.runtime.discovery.etcd import EtcdDiscovery

async def main():
    d = EtcdDiscovery([sys.argv[1]], ttl=int(sys.argv[2]), root=sys.argv[3])
    await d.start()
    await d.put("workers/child", b"alive")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def root() -> str:
    """A private key root per test, so tests sharing one etcd never see each other."""
    return f"turbine-test-{uuid.uuid4().hex}/"


@pytest.fixture
async def open_backends(etcd_endpoint, root):
    made: list[EtcdDiscovery] = []

    async def make(ttl: int = TTL) -> EtcdDiscovery:
        backend = EtcdDiscovery([etcd_endpoint], ttl=ttl, root=root)
        await backend.start()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


async def eventually(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_put_get_delete(open_backends, etcd_endpoint, root):
    owner, reader = await open_backends(), await open_backends()
    await owner.put("instances/ns/c/e/1", b"one")
    await owner.put("instances/ns/c/e/2", b"two")
    await owner.put("models/ns/c/e/1", b"card")
    assert await reader.get_prefix("instances/") == {"instances/ns/c/e/1": b"one", "instances/ns/c/e/2": b"two"}
    await owner.put("instances/ns/c/e/1", b"uno")
    await owner.delete("instances/ns/c/e/2")
    assert await reader.get_prefix("") == {"instances/ns/c/e/1": b"uno", "models/ns/c/e/1": b"card"}
    # Stored under the root prefix, attached to the owner's lease.
    async with Etcd3Client([etcd_endpoint]) as etcd:
        kv = (await etcd.kv.get(root + "models/ns/c/e/1")).kvs[0]
        assert kv.lease == owner.lease_id


async def test_close_revokes_lease_and_keys(open_backends):
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


async def test_sigkilled_process_keys_vanish_within_ttl(open_backends, etcd_endpoint, root, python_child):
    reader = await open_backends()
    proc, line = await python_child(CHILD, etcd_endpoint, TTL, root)
    assert line == "ready"
    assert await reader.get_prefix("workers/") == {"workers/child": b"alive"}
    proc.kill()
    proc.wait()
    took = await eventually(lambda: _empty(reader), timeout=TTL + 3)
    assert took <= TTL + 1.5


async def test_starved_process_vanishes_then_reregisters_without_restart(
    open_backends, etcd_endpoint, root, python_child
):
    reader = await open_backends()
    proc, line = await python_child(CHILD, etcd_endpoint, TTL, root)
    assert line == "ready"
    os.kill(proc.pid, signal.SIGSTOP)  # alive but starved: no keep-alive, the lease expires
    await eventually(lambda: _empty(reader), timeout=TTL + 3)
    os.kill(proc.pid, signal.SIGCONT)
    await eventually(lambda: _equals(reader, {"workers/child": b"alive"}), timeout=3)


async def test_owner_reregisters_after_its_lease_is_revoked(open_backends, etcd_endpoint):
    owner = await open_backends(ttl=3)  # keep-alive every 1 s
    reader = await open_backends()
    await owner.put("a", b"1")
    await owner.put("b", b"2")
    old_lease = owner.lease_id
    async with Etcd3Client([etcd_endpoint]) as etcd:
        await etcd.lease.revoke(old_lease)  # what an expiry during a stall looks like
    assert await reader.get_prefix("") == {}
    await eventually(lambda: _equals(reader, {"a": b"1", "b": b"2"}), timeout=4)
    assert owner.lease_id != old_lease


async def test_put_on_a_revoked_lease_regrants_and_republishes(open_backends, etcd_endpoint):
    owner = await open_backends(ttl=30)  # keep-alive far away: the put must notice by itself
    reader = await open_backends()
    await owner.put("a", b"1")
    async with Etcd3Client([etcd_endpoint]) as etcd:
        await etcd.lease.revoke(owner.lease_id)
    await owner.put("b", b"2")
    assert await reader.get_prefix("") == {"a": b"1", "b": b"2"}


async def test_an_unexpected_keepalive_error_does_not_stop_the_renewals(open_backends, monkeypatch):
    # A process whose keep-alive task died would be dropped for good at its lease's expiry.
    owner = await open_backends()
    reader = await open_backends()
    await owner.put("a", b"1")
    renew, calls = owner._renew, []

    async def failing_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("an error no one foresaw")
        return await renew()

    monkeypatch.setattr(owner, "_renew", failing_once)
    await eventually(lambda: _true(len(calls) >= 3), timeout=TTL + 3)
    assert not owner._task.done()
    assert await reader.get_prefix("") == {"a": b"1"}


async def test_start_fails_clearly_when_etcd_is_unreachable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = EtcdDiscovery([f"127.0.0.1:{port}"], ttl=2, timeout=2)
    with pytest.raises(DiscoveryError, match=f"cannot reach etcd at 127.0.0.1:{port}"):
        await backend.start()


async def test_reaches_etcd_through_a_dns_name(etcd_endpoint, root):
    """As in a container, where etcd is a service name ('turbine-etcd:2379'), not an address.
    'LOCALHOST' is a name (etcd3aio rewrote only the lower-case spelling) that /etc/hosts resolves."""
    if etcd_endpoint.rpartition(":")[0] != "127.0.0.1":
        pytest.fail(f"this test dials the fixture's etcd on 127.0.0.1 by name; it runs at {etcd_endpoint}")
    backend = EtcdDiscovery([f"LOCALHOST:{etcd_endpoint.rpartition(':')[2]}"], ttl=TTL, root=root)
    await backend.start()
    try:
        await backend.put("named", b"yes")
        assert await backend.get_prefix("") == {"named": b"yes"}
    finally:
        await backend.close()


async def test_make_backend_etcd(etcd_endpoint):
    backend = make_backend("etcd", etcd_endpoints=[etcd_endpoint], file_dir=None, ttl=2.5)
    assert isinstance(backend, EtcdDiscovery) and backend.ttl == 3


async def _true(value: bool) -> bool:
    return value


async def _empty(backend):
    return await backend.get_prefix("") == {}


async def _equals(backend, expected, tolerate_outage=False):
    try:
        return await backend.get_prefix("") == expected
    except DiscoveryError:
        if tolerate_outage:
            return False
        raise


async def test_recovers_after_etcd_restarts_without_its_data(tmp_path):
    """A fresh etcd (e.g. no persistent volume): owners re-register and watchers resync."""
    server = EtcdServer(tmp_path)
    await asyncio.to_thread(server.start)
    owner = EtcdDiscovery([server.endpoint], ttl=2)
    reader = EtcdDiscovery([server.endpoint], ttl=2)
    try:
        await owner.start()
        await reader.start()
        for i in range(20):  # move the revision well past what the fresh store will have
            await owner.put("churn", str(i).encode())
        await owner.put("k", b"v")
        seen: list[dict[str, bytes]] = []

        async def watch() -> None:  # consumed all along, as the frontend's model table does
            async for snapshot in reader.watch_prefix(""):
                seen.append(snapshot)

        watcher = asyncio.create_task(watch())
        await eventually(lambda: _true(seen == [{"churn": b"19", "k": b"v"}]), timeout=5)

        server.stop(kill=True)
        server.wipe()
        await asyncio.to_thread(server.start)

        # Our lease is unknown to the new store: the owner re-puts its keys by itself...
        await eventually(lambda: _equals(reader, {"churn": b"19", "k": b"v"}, tolerate_outage=True), timeout=15)
        await owner.put("k2", b"new")
        # ...and the watcher notices that revisions restarted instead of waiting for its old one,
        await eventually(lambda: _true("k2" in seen[-1]), timeout=10)
        watcher.cancel()
        # giving owners time to put their keys again first: it never shows the live owner's keys gone.
        assert all("k" in snapshot for snapshot in seen), seen
    finally:
        await owner.close()
        await reader.close()
        server.stop()

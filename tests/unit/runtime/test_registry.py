"""The typed registry, on both discovery backends."""

import asyncio
import logging
import uuid

import pytest

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.runtime.discovery import Registry
from turbine.runtime.discovery.etcd import EtcdDiscovery
from turbine.runtime.discovery.file import FileDiscovery

pytestmark = pytest.mark.asyncio(loop_scope="session")


def instance(iid: str, component: str = "backend") -> InstanceRecord:
    return InstanceRecord(
        namespace="dyn", component=component, endpoint="generate", instance_id=iid, address=f"127.0.0.1:{1000 + len(iid)}"
    )


def card(iid: str) -> ModelCard:
    return ModelCard(
        name="smol",
        namespace="dyn",
        component="backend",
        endpoint="generate",
        instance_id=iid,
        tokenizer_path="/models/smol",
        context_length=2048,
        kv_block_size=16,
        total_kv_blocks=100,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
    )


@pytest.fixture(params=["file", "etcd"])
async def backends(request, tmp_path):
    """Two started backends on the same store: one for a worker, one for a frontend."""
    if request.param == "file":
        made = [FileDiscovery(tmp_path, ttl=2, poll_interval=0.05) for _ in range(2)]
    else:
        endpoint = request.getfixturevalue("etcd_endpoint")
        root = f"turbine-test-{uuid.uuid4().hex}/"
        made = [EtcdDiscovery([endpoint], ttl=2, root=root) for _ in range(2)]
    for backend in made:
        await backend.start()
    yield made
    for backend in made:
        await backend.close()


async def test_register_list_unregister(backends):
    worker, frontend = Registry(backends[0]), Registry(backends[1])
    await worker.register_instance(instance("a1"))
    await worker.register_instance(instance("b2", component="prefill"))
    await worker.register_model(card("a1"))
    assert await frontend.list_instances() == [instance("a1"), instance("b2", component="prefill")]
    assert await frontend.list_models() == [card("a1")]
    # The raw layout other tools rely on.
    assert set(await backends[1].get_prefix("")) == {
        "instances/dyn/backend/generate/a1",
        "instances/dyn/prefill/generate/b2",
        "models/dyn/backend/generate/a1",
    }
    await worker.unregister_instance(instance("a1"))
    assert await frontend.list_instances() == [instance("b2", component="prefill")]
    assert await frontend.list_models() == []


async def test_watch_snapshots_and_skips_undecodable_values(backends, caplog):
    worker, frontend = Registry(backends[0]), Registry(backends[1])
    await worker.register_instance(instance("a1"))
    watch = frontend.watch()
    async with asyncio.timeout(5):
        assert await anext(watch) == ([instance("a1")], [])
        await worker.register_model(card("a1"))
        assert await anext(watch) == ([instance("a1")], [card("a1")])
        with caplog.at_level(logging.WARNING, logger="turbine.discovery"):
            await backends[0].put("instances/dyn/backend/generate/bad", b"\xc1 not msgpack")
            await worker.register_instance(instance("c3"))
            while (snapshot := await anext(watch))[0] != [instance("a1"), instance("c3")]:
                pass
        assert snapshot[1] == [card("a1")]
        assert any("instances/dyn/backend/generate/bad" in r.getMessage() for r in caplog.records)
        await worker.unregister_instance(instance("a1"))
        while (snapshot := await anext(watch))[0] != [instance("c3")]:
            pass
        assert snapshot[1] == []
    await watch.aclose()


async def test_paths_with_slashes_are_rejected(backends):
    with pytest.raises(ValueError, match="no '/'"):
        await Registry(backends[0]).register_instance(instance("a/b"))

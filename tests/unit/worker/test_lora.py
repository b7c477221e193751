"""The LoRA load / unload sequence of one instance (turbine/worker/lora.py) against real discovery
(a file directory; a private etcd that is stopped to make publishing fail), a real request-plane
server, real adapters made with peft for the embedded model, and an engine stand-in that records
what it is asked."""

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.etcd_server import EtcdServer
from tests.lora_adapters import build_adapter, build_tiny_adapter, corrupt_copy
from turbine.protocol.discovery import ModelCard
from turbine.protocol.lora import LIST_LORAS, LOAD_LORA, ListLorasReply, ListLorasRequest, LoadLoraRequest, \
    LoraReply, LoraSource
from turbine.runtime.discovery.etcd import EtcdDiscovery
from turbine.runtime.discovery.file import FileDiscovery
from turbine.runtime.discovery.registry import Registry
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer
from turbine.worker.lora import LoraManager, NoLora
from turbine.worker.lora_check import AdapterError
from turbine.worker.lora_sources import resolve_source
from turbine.worker.sleep import CannotSleep, InstanceSleep

CARD = ModelCard(name="base", namespace="ns", component="backend", endpoint="generate", instance_id="i1",
                 engine="test", tokenizer_path="/tmp", context_length=128, kv_block_size=16, total_kv_blocks=8,
                 max_num_seqs=4, max_num_batched_tokens=128, tool_call_parser="hermes", reasoning_parser="qwen3")


class Engine:
    """Takes adapters; each add waits for `gate` (to hold loads in flight) and is recorded."""

    def __init__(self, model_dir: str | None, max_rank: int = 8):
        self.base_model_dir = model_dir
        self.max_lora_rank = max_rank
        self.adds: list[tuple[str, int, str]] = []
        self.removes: list[tuple[str, int]] = []
        self.loaded: dict[str, int] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None
        self.fail_remove = False

    def lora_refusal(self):
        return None

    async def add(self, name, lora_id, path):
        self.adds.append((name, lora_id, path))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        self.loaded[name] = lora_id

    async def remove(self, name, lora_id):
        self.removes.append((name, lora_id))
        if self.fail_remove:
            raise RuntimeError("the engine could not remove it")
        self.loaded.pop(name, None)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    good = build_adapter(str(model_dir), root / "good")
    return {"good": good, "corrupt": corrupt_copy(good, root / "corrupt"),
            "rank16": build_adapter(str(model_dir), root / "rank16", rank=16),
            "tiny": build_tiny_adapter(root / "tiny")}


async def _instance(registry: Registry, engine: Engine):
    server = RequestPlaneServer()
    await server.start()
    sleeper = InstanceSleep(server, CARD, CannotSleep("no"), registry, drain_timeout=1.0)
    await sleeper.register()
    manager = LoraManager(CARD, engine, sleeper)
    manager.serve(server)
    return server, sleeper, manager


async def _adapter_cards(registry: Registry) -> dict[str, ModelCard]:
    return {c.lora_name: c for c in await registry.list_models() if c.lora_name is not None}


def test_a_load_publishes_its_own_card_and_unload_withdraws_it(tmp_path, adapters, model_dir):
    async def go():
        registry = Registry(FileDiscovery(str(tmp_path / "d")))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        server, sleeper, manager = await _instance(registry, engine)
        try:
            reply = await manager.load("sql", str(adapters["good"]))
            assert reply.status == "success" and reply.lora_name == "sql" and reply.lora_id >= 1
            cards = await _adapter_cards(registry)
            card = cards["sql"]
            assert (card.name, card.lora_id, card.base_model) == ("sql", reply.lora_id, "base")
            # parsers and limits are the base card's; the key is its own, under the instance's
            assert (card.tool_call_parser, card.reasoning_parser, card.context_length) == ("hermes", "qwen3", 128)
            assert card.path == CARD.path and card.key == f"{CARD.path}/lora/sql"
            assert [c.name for c in await registry.list_models()] == ["base", "sql"]
            assert [i.lora_name for i in manager.list()] == ["sql"] and manager.list()[0].rank == 8
            # the request plane lists it
            client = RequestPlaneClient()
            listed = [r async for r in client.stream(server.address, LIST_LORAS, ListLorasRequest(),
                                                     ListLorasReply)]
            assert [i.lora_name for i in listed[0].loras] == ["sql"]
            await client.close()
            # unregistering the instance (sleep, SIGTERM) takes the adapter's card with it, and
            # registering again brings it back
            await sleeper.unregister()
            assert await registry.list_models() == []
            await sleeper.register()
            assert set(await _adapter_cards(registry)) == {"sql"}
            reply = await manager.unload("sql")
            assert reply.status == "success" and engine.removes == [("sql", card.lora_id)]
            assert await _adapter_cards(registry) == {} and manager.list() == []
            assert (await manager.unload("sql")).code == "not_found"
        finally:
            await server.stop()
            await registry.backend.close()
        # the process's lease gone (closed, or expired): nothing of it is left
        reader = Registry(FileDiscovery(str(tmp_path / "d")))
        assert await reader.list_models() == []
    asyncio.run(go())


def test_ten_concurrent_loads_of_one_name_load_once_and_all_succeed(tmp_path, adapters, model_dir):
    async def go():
        registry = Registry(FileDiscovery(str(tmp_path)))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        server, _, manager = await _instance(registry, engine)
        try:
            uri = f"file://{adapters['good']}"
            replies = await asyncio.gather(*(manager.load("sql", uri) for _ in range(10)))
            assert [r.status for r in replies] == ["success"] * 10
            assert len({r.lora_id for r in replies}) == 1
            assert len(engine.adds) == 1  # serialized by the name's lock, then answered as loaded
            # the same name from another source: refused, the loaded one stays
            other = await manager.load("sql", str(adapters["rank16"]))
            assert other.status == "error" and "unload it first" in other.message and len(engine.adds) == 1
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())


def test_loads_of_different_names_proceed_concurrently(tmp_path, adapters, model_dir):
    async def go():
        registry = Registry(FileDiscovery(str(tmp_path)))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        engine.gate = asyncio.Event()
        server, _, manager = await _instance(registry, engine)
        try:
            loads = [asyncio.create_task(manager.load(n, str(adapters["good"]))) for n in ("a", "b", "c")]
            for _ in range(200):
                if engine.in_flight == 3:
                    break
                await asyncio.sleep(0.02)
            assert engine.in_flight == 3  # all three inside the engine at once: no lock across names
            engine.gate.set()
            assert [r.status for r in await asyncio.gather(*loads)] == ["success"] * 3
            assert len({r.lora_id for r in await asyncio.gather(*loads)}) == 3
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())


@pytest.mark.parametrize("which, words", [
    ("corrupt", "truncated or corrupt"),
    ("rank16", "rank is 16, above this worker's --max-lora-rank 8"),
    ("tiny", "wrong base model"),
    ("missing", "not a folder"),
    ("no-config", "no adapter_config.json"),
    ("pickle", "adapter_model.bin is a pickle"),
    ("s3", "s3:// sources are not supported"),
    ("ftp", "unsupported source scheme 'ftp'"),
])
def test_a_bad_adapter_is_refused_and_nothing_is_registered(tmp_path, adapters, model_dir, which, words):
    uri = {"corrupt": str(adapters["corrupt"]), "rank16": str(adapters["rank16"]), "tiny": str(adapters["tiny"]),
           "missing": str(tmp_path / "nowhere"), "s3": "s3://bucket/adapter", "ftp": "ftp://host/a"}.get(which)
    if which == "no-config":
        (tmp_path / "empty").mkdir()
        uri = str(tmp_path / "empty")
    if which == "pickle":
        (tmp_path / "bin").mkdir()
        shutil.copy(adapters["good"] / "adapter_config.json", tmp_path / "bin")
        (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
        uri = str(tmp_path / "bin")

    async def go():
        registry = Registry(FileDiscovery(str(tmp_path / "d")))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        server, _, manager = await _instance(registry, engine)
        try:
            # over the request plane, as a frontend or an operator's tool would
            client = RequestPlaneClient()
            replies = [r async for r in client.stream(server.address, LOAD_LORA, LoadLoraRequest(
                lora_name="bad", source=LoraSource(uri=uri)), LoraReply)]
            await client.close()
            assert replies[0].status == "error" and words in replies[0].message and replies[0].code == "invalid"
            assert engine.adds == [] and manager.list() == [] and await _adapter_cards(registry) == {}
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())


def test_names_and_engines_that_take_no_adapters_are_refused(tmp_path, adapters):
    async def go():
        registry = Registry(FileDiscovery(str(tmp_path)))
        await registry.backend.start()
        server = RequestPlaneServer()
        await server.start()
        sleeper = InstanceSleep(server, CARD, CannotSleep("no"), registry, drain_timeout=1.0)
        try:
            manager = LoraManager(CARD, NoLora("start it with --enable-lora"), sleeper)
            reply = await manager.load("sql", str(adapters["good"]))
            assert reply.code == "unsupported" and "--enable-lora" in reply.message
            manager = LoraManager(CARD, Engine(None), sleeper)
            for name in ("a/b", "", "base", "x" * 200, "-x"):
                assert (await manager.load(name, str(adapters["good"]))).code == "invalid", name
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())


def test_hf_sources_without_a_reachable_hub_fail_clearly(tmp_path, monkeypatch):
    # Nothing listens on port 9 of loopback: the hub is unreachable (this machine has no hub access anyway).
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(AdapterError, match="could not download from the Hugging Face hub"):
        resolve_source("hf://someone/some-adapter", tmp_path)
    with pytest.raises(AdapterError, match="hf://owner/repo"):
        resolve_source("hf://just-a-name", tmp_path)
    # a copy downloaded before is found in the cache without the hub
    cached = tmp_path / "hf" / "someone--some-adapter@v1".replace("@", "--")
    cached.mkdir(parents=True)
    (cached / "adapter_config.json").write_text("{}")
    assert resolve_source("hf://someone/some-adapter@v1", tmp_path) == str(cached)


def test_publishing_fails_so_the_engine_load_is_rolled_back_and_unload_is_reversed(tmp_path, adapters, model_dir):
    """A real etcd, stopped under the worker: the adapter's card cannot be put, so the adapter is
    removed from the engine again; an unload whose card cannot be withdrawn keeps it loaded."""
    async def go():
        etcd = EtcdServer(tmp_path)
        etcd.start()
        registry = Registry(EtcdDiscovery([etcd.endpoint], ttl=10, timeout=1.0))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        server, sleeper, manager = await _instance(registry, engine)
        try:
            assert (await manager.load("kept", str(adapters["good"]))).status == "success"
            etcd.stop()
            reply = await manager.load("sql", str(adapters["good"]))
            assert reply.status == "error" and reply.code == "failed" and "unloaded again" in reply.message
            assert [a[0] for a in engine.adds] == ["kept", "sql"] and engine.removes == [("sql", engine.adds[1][1])]
            assert "sql" not in engine.loaded and [i.lora_name for i in manager.list()] == ["kept"]
            assert "sql" not in sleeper.adapter_cards  # nothing to re-put when etcd is back
            reply = await manager.unload("kept")
            assert reply.status == "error" and "stays loaded" in reply.message
            assert "kept" in engine.loaded and [i.lora_name for i in manager.list()] == ["kept"]
            assert len(engine.removes) == 1  # the engine was not asked to remove it
        finally:
            await server.stop()
            await registry.backend.close()
            etcd.stop()
    asyncio.run(go())


def test_the_engine_failing_to_unload_puts_the_card_back(tmp_path, adapters, model_dir):
    async def go():
        registry = Registry(FileDiscovery(str(tmp_path)))
        await registry.backend.start()
        engine = Engine(str(model_dir))
        server, _, manager = await _instance(registry, engine)
        try:
            assert (await manager.load("sql", str(adapters["good"]))).status == "success"
            engine.fail_remove = True
            reply = await manager.unload("sql")
            assert reply.status == "error" and reply.code == "failed"
            assert set(await _adapter_cards(registry)) == {"sql"} and [i.lora_name for i in manager.list()] == ["sql"]
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())

"""The sleep sequence of one instance against a real file discovery and a real request-plane
server: a refusal changes nothing; sleep leaves discovery before the engine sleeps; wake wakes the
engine before it registers again."""

import asyncio

import pytest

from turbine.protocol.discovery import ModelCard
from turbine.runtime.discovery.file import FileDiscovery
from turbine.runtime.discovery.registry import Registry
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.worker.sleep import CannotSleep, InstanceSleep, SleepUnsupported

CARD = ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id="i1",
                 engine="test", tokenizer_path="/tmp", context_length=128, kv_block_size=16, total_kv_blocks=8,
                 max_num_seqs=4, max_num_batched_tokens=128)


class RecordingEngine:
    """An engine whose sleep notes how many instance records (what routers route to) discovery held then."""

    def __init__(self, registry):
        self.registry = registry
        self.seen: list[tuple[str, int]] = []

    def sleep_refusal(self, level):
        return None

    async def sleep(self, level):
        self.seen.append(("sleep", len(await self.registry.list_instances())))

    async def wake_up(self):
        self.seen.append(("wake", len(await self.registry.list_instances())))


async def _with_instance(tmp_path, engine_of):
    registry = Registry(FileDiscovery(str(tmp_path)))
    await registry.backend.start()
    server = RequestPlaneServer()
    await server.start()
    instance = InstanceSleep(server, CARD, engine_of(registry), registry, drain_timeout=1.0)
    await instance.register()
    return registry, server, instance


def test_a_refusal_changes_nothing(tmp_path):
    async def go():
        registry, server, instance = await _with_instance(tmp_path, lambda r: CannotSleep("no sleep here"))
        try:
            with pytest.raises(SleepUnsupported, match="no sleep here"):
                await instance.sleep(1)
            assert instance.level == 0 and len(await registry.list_models()) == 1
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())


def test_unregistered_before_the_engine_sleeps_registered_after_it_wakes(tmp_path):
    async def go():
        registry, server, instance = await _with_instance(tmp_path, RecordingEngine)
        try:
            assert (await instance.sleep(2)).level == 2
            # Out of routing (no instance record), its card kept and marked asleep (a frontend's 503, not 404).
            assert await registry.list_instances() == []
            assert [card.sleeping for card in await registry.list_models()] == [True]
            assert (await instance.wake_up()).is_sleeping is False
            assert [card.sleeping for card in await registry.list_models()] == [False]
            assert len(await registry.list_instances()) >= 1
            assert instance.engine.seen == [("sleep", 0), ("wake", 0)]
            with pytest.raises(ValueError, match="level 0"):
                await instance.sleep(0)
        finally:
            await server.stop()
            await registry.backend.close()
    asyncio.run(go())

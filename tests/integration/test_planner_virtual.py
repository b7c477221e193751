"""The planner's virtual connector against real discovery (a directory, and a private etcd): each
decision lands at planner/<ns>/decision for an outside orchestrator, set_replicas returns only once
that orchestrator acknowledges it (or times out), and the serving workers are counted per role from
the model cards in discovery. The orchestrator here is a second discovery client with its own lease."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from turbine.config import DiscoveryConfig, make_registry
from turbine.planner.connector import make_connector
from turbine.planner.connectors.virtual import VirtualConnector, VirtualConnectorConfig
from turbine.protocol.discovery import ModelCard
from turbine.protocol.planner import PlannerAck, PlannerDecision

NS = "plan-ns"


@pytest.fixture(params=["file", "etcd"])
def discovery(request, tmp_path):
    if request.param == "file":
        return DiscoveryConfig(backend="file", file_dir=str(tmp_path / "discovery"), ttl=3.0)
    return DiscoveryConfig(backend="etcd", etcd_endpoints=(request.getfixturevalue("etcd_endpoint"),), ttl=3.0)


def card(iid: str, role: str, namespace: str = NS) -> ModelCard:
    return ModelCard(name="m", namespace=namespace, component="prefill" if role == "prefill" else "backend",
                     endpoint="generate", instance_id=iid, tokenizer_path="/m", context_length=2048,
                     kv_block_size=16, total_kv_blocks=100, max_num_seqs=8, max_num_batched_tokens=2048,
                     disaggregation_mode=role)


async def read(backend, key: str):
    return (await backend.get_prefix(key)).get(key)


async def until(cond, what: str, timeout: float = 10):
    async with asyncio.timeout(timeout):
        while not await cond():
            await asyncio.sleep(0.05)


async def test_a_decision_waits_for_the_orchestrators_acknowledgement(discovery):
    class PlannerConfig:
        connector_options = {"ack_timeout": 30}
        namespace = NS

    PlannerConfig.discovery = discovery
    conn = make_connector("virtual", PlannerConfig())
    assert isinstance(conn, VirtualConnector)
    orchestrator = make_registry(discovery)  # its own lease, as a separate process would have
    await conn.start()
    await orchestrator.backend.start()
    key, ack = f"planner/{NS}/decision", f"planner/{NS}/ack"
    try:
        # Workers as the orchestrator runs them: counted by their cards' roles, this namespace only.
        for c in (card("a1", "agg"), card("a2", "agg"), card("p1", "prefill"), card("x1", "agg", "other-ns")):
            await orchestrator.register_model(c)
        await until(lambda: _eq(conn.current_replicas(), {"agg": 2, "prefill": 1, "decode": 0}), "cards counted")

        task = asyncio.create_task(conn.set_replicas({"prefill": 2, "decode": 3}, decision_id=7))
        await until(lambda: _present(orchestrator.backend, key), "the decision in discovery")
        decision = msgspec.json.decode(await read(orchestrator.backend, key), type=PlannerDecision)
        assert (decision.decision_id, decision.targets) == (7, {"prefill": 2, "decode": 3})
        await asyncio.sleep(1.0)
        assert not task.done()  # no acknowledgement yet
        await orchestrator.backend.put(ack, msgspec.json.encode(PlannerAck(decision_id=6)))  # an older one
        await orchestrator.backend.put(ack + "-not-it", b"{}")
        await asyncio.sleep(1.0)
        assert not task.done()
        await orchestrator.backend.put(ack, b"not json")  # unreadable: ignored, still waiting
        await asyncio.sleep(0.5)
        assert not task.done()
        await orchestrator.backend.put(ack, msgspec.json.encode(PlannerAck(decision_id=7)))
        await asyncio.wait_for(task, 10)
        assert await conn.acknowledged() == 7
        # Acknowledged, not registered yet: starting (prefill 2 asked, 1 card; decode 3 asked, none).
        assert await conn.starting_replicas() == {"prefill": 1, "decode": 3}
        await orchestrator.register_model(card("d1", "decode"))
        await until(lambda: _eq(conn.starting_replicas(), {"prefill": 1, "decode": 2}), "a card counts as ready")

        # A later decision replaces the key; an acknowledgement of a later one covers it too.
        task = asyncio.create_task(conn.set_replicas({"agg": 0}, decision_id=8))
        await until(lambda: _decision_id_is(orchestrator.backend, key, 8), "decision 8 in discovery")
        await orchestrator.backend.put(ack, msgspec.json.encode(PlannerAck(decision_id=9)))
        await asyncio.wait_for(task, 10)

        with pytest.raises(ValueError, match="unknown role"):
            await conn.set_replicas({"encode": 1}, decision_id=10)
    finally:
        await conn.close()
    # The decision lived on the planner's lease: gone with it.
    await until(lambda: _absent(orchestrator.backend, key), "the decision gone with the planner")
    await orchestrator.backend.close()


async def test_an_unacknowledged_decision_times_out(discovery):
    conn = VirtualConnector(VirtualConnectorConfig(discovery=discovery, namespace=NS + "-t", ack_timeout=0.8))
    await conn.start()
    try:
        with pytest.raises(TimeoutError, match=r"decision 1 not acknowledged at planner/plan-ns-t/ack within 0.8s"):
            await conn.set_replicas({"agg": 2}, decision_id=1)
    finally:
        await conn.close()


async def _eq(coro, want) -> bool:
    return await coro == want


async def _present(backend, key) -> bool:
    return await read(backend, key) is not None


async def _absent(backend, key) -> bool:
    return await read(backend, key) is None


async def _decision_id_is(backend, key, n) -> bool:
    raw = await read(backend, key)
    return raw is not None and msgspec.json.decode(raw, type=PlannerDecision).decision_id == n

"""The planner's local connector on real simulated-worker processes behind the real frontend, under a
steady stream of streamed requests (the official openai client): scale 1 -> 2 (the new worker serves
once registered), then 2 -> 1: the connector stops the least-loaded worker, which drains (and hands
what outlives its drain to the frontend to migrate) before it exits; not one request fails."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from tests.integration.planner_traffic import SteadyTraffic
from tests.integration.procs import (
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    start_planner,
    stop_all,
)
from tests.unit.planner.test_replicas import PROFILE
from turbine.config import DiscoveryConfig
from turbine.model.prepare import DEFAULT_MODEL
from turbine.planner.connectors.local import LocalConnector, LocalConnectorConfig, LocalRole
from turbine.planner.profile import write_engine_profile
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime.request_plane import RequestPlaneClient

MODEL = DEFAULT_MODEL
MOCKER = ("--block-size", "16", "--reply-text", " the")


async def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if await cond():
                return
        except OSError:  # (a process not listening yet)
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def worker_metric(worker, name: str) -> float:
    return metric(http_text(f"http://127.0.0.1:{worker.system_port}/metrics"), name)


@pytest.fixture
def cluster(tmp_path):
    disc = tmp_path / "discovery"
    env = base_env(str(disc))
    frontend = start_frontend("frontend", env, tmp_path, "--migration-limit", "2")
    cfg = LocalConnectorConfig(roles={"agg": LocalRole("mocker", MOCKER)},
                               discovery=DiscoveryConfig(backend="file", file_dir=str(disc), ttl=3.0),
                               log_dir=str(tmp_path / "workers"), drain_timeout=3.0)
    try:
        yield frontend, cfg
    finally:
        stop_all([frontend])


async def test_scale_up_then_drained_scale_down_of_the_least_loaded_worker_fails_no_request(cluster):
    frontend, cfg = cluster
    conn = LocalConnector(cfg)
    await conn.start()
    pinned: list[asyncio.Task] = []
    client = RequestPlaneClient()
    traffic = None
    try:
        await conn.set_replicas({"agg": 1}, decision_id=1)
        assert await conn.current_replicas() == {"agg": 0}  # started, not registered yet
        assert await conn.starting_replicas() == {"agg": 1}
        await until(lambda: _replicas(conn, 1), 60, "the first worker registered")
        assert await conn.starting_replicas() == {"agg": 0}
        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 30, "the frontend sees it")
        old = conn.serving("agg")[0]

        traffic = SteadyTraffic(frontend.url, MODEL, clients=4, tokens=(20, 120))
        await until(lambda: _async(traffic.ok >= 4), 60, "traffic under way")

        # 1 -> 2: the new worker counts once registered, and the frontend sends it requests.
        await conn.set_replicas({"agg": 2}, decision_id=2)
        new = next(w for w in conn.serving("agg") if w is not old)
        await until(lambda: _replicas(conn, 2), 60, "the second worker registered")
        await until(lambda: _async(worker_metric(new, "turbine_worker_requests_total") >= 3), 30,
                    "the new worker serving the frontend's requests")

        # Make the older worker the less loaded one: long streams straight to the new one's
        # request plane (a connector stopping the youngest, or any other, would stop it instead).
        address = next(i.address for i in await conn.registry.list_instances()
                       if i.pid == new.pid and i.endpoint == "generate")
        pinned = [asyncio.create_task(_long_stream(client, address, k)) for k in range(6)]
        await until(lambda: _async(worker_metric(new, "turbine_worker_inflight_requests")
                                   >= worker_metric(old, "turbine_worker_inflight_requests") + 3), 30,
                    "the new worker more loaded")
        assert worker_metric(old, "turbine_worker_inflight_requests") >= 1  # it has streams to drain

        # 2 -> 1 under traffic: the least-loaded (older) worker is the one stopped; set_replicas
        # returns once it has drained and exited.
        t_down = time.monotonic()
        await conn.set_replicas({"agg": 1}, decision_id=3)
        assert old.stop_requested_at is not None and new.stop_requested_at is None
        assert conn.last_loads[old.name] + 3 <= conn.last_loads[new.name]
        assert not old.alive() and old.returncode == 0
        assert await conn.current_replicas() == {"agg": 1}
        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 30, "the frontend down to one worker")
        await until(lambda: _async(traffic.completed_since(t_down + 4) >= 8), 60, "traffic served after it")
        traffic.stop()
        assert traffic.failures == [], traffic.failures[:5]
        assert traffic.ok >= 20
        for task in pinned:
            assert await task == 250  # the pinned streams ran whole on the survivor
    finally:
        if traffic is not None:
            traffic.stop()
        for task in pinned:
            task.cancel()
        await client.close()
        await conn.close()
    assert not any(w.alive() for w in conn.workers)


async def _replicas(conn: LocalConnector, n: int) -> bool:
    return (await conn.current_replicas())["agg"] == n


async def _async(value: bool) -> bool:
    return value


async def _long_stream(client: RequestPlaneClient, address: str, k: int) -> int:
    request = GenerateRequest(request_id=f"pinned-{k}", model=MODEL, token_ids=[1000 + k, 2000, 3000],
                              stop=StopConditions(max_tokens=250, ignore_eos=True))
    tokens = 0
    async for out in client.stream(address, "generate", request, GenerateOutput):
        tokens += len(out.token_ids)
    return tokens


async def test_a_worker_of_this_host_started_elsewhere_is_adopted_and_stopped_gracefully(cluster, tmp_path):
    """A worker already registered from this host (left by a planner that crashed, or started by hand)
    counts as the connector's, and a scale-down stops it with SIGTERM: it drains and exits 0."""
    frontend, cfg = cluster
    env = base_env(cfg.discovery.file_dir)
    stray = start_mocker("stray", env, tmp_path, *MOCKER)
    conn = LocalConnector(cfg)
    await conn.start()
    try:
        await until(lambda: _replicas(conn, 1), 60, "the stray worker adopted")
        adopted = conn.serving("agg")[0]
        assert adopted.pid == stray.popen.pid and adopted.popen is None and adopted.name.endswith("-adopted")
        await conn.set_replicas({"agg": 0}, decision_id=1)
        assert stray.popen.wait(5) == 0  # SIGTERM: unregister, drain, exit 0
        assert await conn.current_replicas() == {"agg": 0}
    finally:
        await conn.close()
        stray.stop()


async def test_without_adopt_a_foreign_worker_is_left_alone(cluster, tmp_path):
    frontend, cfg = cluster
    stray = start_mocker("stray", base_env(cfg.discovery.file_dir), tmp_path, *MOCKER)
    conn = LocalConnector(dataclasses.replace(cfg, adopt=False))
    await conn.start()
    try:
        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 60, "the stray worker registered")
        assert await conn.current_replicas() == {"agg": 0}
        await conn.set_replicas({"agg": 0}, decision_id=1)
        assert stray.alive()
    finally:
        await conn.close()
        stray.stop()


async def test_the_planner_starts_an_empty_fleet_with_the_local_connector(cluster, tmp_path):
    """No worker runs: the planner starts its connector first and brings the role to its minimum
    (decision 1, the start-up path), then waits for those workers to be visible and plans. SIGTERM:
    it closes the connector, which stops (drains) the workers it started."""
    frontend, cfg = cluster
    profile = tmp_path / "profile.json"
    write_engine_profile(PROFILE, profile)
    config = {"profile": str(profile), "mode": "agg", "model": MODEL, "ttft_ms": 1000, "itl_ms": 30,
              "connector": "local", "frontend_url": frontend.url, "min_replicas": {"agg": 2},
              "max_replicas": {"agg": 3}, "adjustment_interval_s": 5, "fast_interval_s": 1,
              "connector_options": {"roles": {"agg": {"engine": "mocker", "args": list(MOCKER)}},
                                    "log_dir": str(tmp_path / "planner-workers"), "drain_timeout": 3}}
    (tmp_path / "planner.json").write_text(json.dumps(config))
    env = base_env(cfg.discovery.file_dir)
    planner = start_planner("planner-empty", env, tmp_path, "--config", str(tmp_path / "planner.json"),
                            port=free_port())
    try:
        await until(lambda: _async(http_json(f"{planner.url}/health")[0] == 200), 90, "the planner healthy")
        # Healthy once a worker of the role is visible; the second may still be starting (a loaded host).
        await until(lambda: _async(http_json(f"{planner.url}/health")[1]["workers"] == {"agg": 2}), 30,
                    "the planner sees both workers")
        await until(lambda: _async(instances_of(frontend, MODEL) == 2), 30, "the frontend sees both workers")
        assert "decision 1 (startup path): {'agg': 0} -> {'agg': 2}" in planner.log_tail(200)
        text = http_text(f"{planner.url}/metrics")
        assert 'turbine_planner_decisions_total{direction="up",path="startup",role="agg"} 1.0' in text
    finally:
        assert planner.stop() == 0
    # Its connector's workers went with it (drained).
    await until(lambda: _async(instances_of(frontend, MODEL) == 0), 30, "the workers stopped with the planner")

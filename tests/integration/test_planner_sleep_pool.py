"""The planner's sleeping pool on real simulated-worker processes behind the real frontend: the
local connector with `sleep_pool` puts the worker a step down removes to sleep (drained: not one
request of a steady stream fails) and a step up wakes it instead of starting a process (the
processes spawned are counted); and the planner wakes a sleeping model on demand: a request
answered 503 `model_asleep` makes it wake a worker, and the next request is served."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.integration.planner_traffic import SteadyTraffic
from tests.integration.procs import (
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    start_frontend,
    start_mocker,
    start_planner,
    stop_all,
)
from tests.integration.test_planner_local_mocker import MOCKER, MODEL, _async, _replicas, until
from tests.unit.planner.test_replicas import PROFILE
from turbine.config import DiscoveryConfig
from turbine.planner.connectors.local import LocalConnector, LocalConnectorConfig, LocalRole
from turbine.planner.profile import write_engine_profile


@pytest.fixture
def cluster(tmp_path):
    disc = tmp_path / "discovery"
    env = base_env(str(disc))
    frontend = start_frontend("frontend", env, tmp_path, "--migration-limit", "2")
    cfg = LocalConnectorConfig(roles={"agg": LocalRole("mocker", MOCKER)},
                               discovery=DiscoveryConfig(backend="file", file_dir=str(disc), ttl=3.0),
                               log_dir=str(tmp_path / "workers"), drain_timeout=3.0, sleep_pool=1)
    try:
        yield frontend, cfg
    finally:
        stop_all([frontend])


def is_sleeping(port: int) -> bool:
    return http_json(f"http://127.0.0.1:{port}/engine/is_sleeping")[1]["is_sleeping"]


async def test_a_step_down_sleeps_a_drained_worker_and_a_step_up_wakes_it_instead_of_starting_one(cluster):
    frontend, cfg = cluster
    conn = LocalConnector(cfg)
    await conn.start()
    traffic = None
    try:
        await conn.set_replicas({"agg": 2}, decision_id=1)
        await until(lambda: _replicas(conn, 2), 60, "two workers registered")
        await until(lambda: _async(instances_of(frontend, MODEL) == 2), 30, "the frontend sees both")
        spawned = len(conn.workers)
        traffic = SteadyTraffic(frontend.url, MODEL, clients=4, tokens=(20, 120))
        await until(lambda: _async(traffic.ok >= 8), 60, "traffic under way")

        # 2 -> 1: the pool has room, so the picked worker drains and sleeps; no process exits.
        await conn.set_replicas({"agg": 1}, decision_id=2)
        [sleeper] = conn.sleeping("agg")
        assert sleeper.alive() and sleeper.stop_requested_at is None and sleeper.sleeps == 1
        assert is_sleeping(sleeper.system_port)
        assert await conn.current_replicas() == {"agg": 1}
        assert await conn.starting_replicas() == {"agg": 0}
        assert await conn.sleeping_replicas() == {"agg": 1}
        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 30, "the frontend down to one worker")
        served_before = traffic.ok

        # 1 -> 2: the sleeper is woken (registered again on return), no process is started.
        await conn.set_replicas({"agg": 2}, decision_id=3)
        assert len(conn.workers) == spawned  # nothing spawned: the step up was a wake
        assert sleeper.wakes == 1 and not sleeper.asleep and not is_sleeping(sleeper.system_port)
        assert await conn.current_replicas() == {"agg": 2}
        assert await conn.sleeping_replicas() == {"agg": 0}
        await until(lambda: _async(instances_of(frontend, MODEL) == 2), 30, "the frontend sees the woken worker")
        port = sleeper.system_port
        await until(lambda: _async(_served(port) >= 3), 60, "the woken worker serving the frontend's requests")
        await until(lambda: _async(traffic.ok >= served_before + 8), 60, "traffic served after the wake")

        traffic.stop()
        assert traffic.failures == [], traffic.failures[:5]  # the sleep drained, the wake lost nothing
        assert traffic.ok >= 20

        # The pool holds one: 2 -> 0 sleeps one and stops the other (it exits, drained).
        await conn.set_replicas({"agg": 0}, decision_id=4)
        stopped = [w for w in conn.workers if w.stop_requested_at is not None]
        assert len(conn.sleeping("agg")) == 1 and len(stopped) == 1 and stopped[0].returncode == 0
    finally:
        if traffic is not None:
            traffic.stop()
        await conn.close()
    assert not any(w.alive() for w in conn.workers)  # the sleeper too: it stops on close


def _served(port: int) -> float:
    from tests.integration.procs import metric

    return metric(http_text(f"http://127.0.0.1:{port}/metrics"), "turbine_worker_requests_total")


async def test_a_request_for_a_model_whose_workers_all_sleep_wakes_one(cluster, tmp_path):
    """The planner (min 0, a pool of 1) puts its idle worker to sleep; a request then finds every
    worker asleep (503 model_asleep with Retry-After); the planner sees the frontend count it and
    wakes the worker (no process is started), and the retried request is served."""
    frontend, cfg = cluster
    env = base_env(cfg.discovery.file_dir)
    worker = start_mocker("pooled", env, tmp_path, *MOCKER)  # adopted: its --system-port is on its command line
    profile = tmp_path / "profile.json"
    write_engine_profile(PROFILE, profile)
    spawned = tmp_path / "planner-workers"
    config = {"profile": str(profile), "mode": "agg", "model": MODEL, "ttft_ms": 1000, "itl_ms": 30,
              "predictor": "constant", "connector": "local", "frontend_url": frontend.url,
              "min_replicas": {"agg": 0}, "max_replicas": {"agg": 1}, "adjustment_interval_s": 5,
              "fast_interval_s": 1, "startup_s": 5, "wake_s": 0.5,
              "connector_options": {"roles": {"agg": {"engine": "mocker", "args": list(MOCKER)}},
                                    "log_dir": str(spawned), "drain_timeout": 3, "sleep_pool": 1}}
    (tmp_path / "planner.json").write_text(json.dumps(config))
    planner = start_planner("planner-pool", env, tmp_path, "--config", str(tmp_path / "planner.json"),
                            port=free_port())
    client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        await until(lambda: _async(http_json(f"{planner.url}/health")[0] == 200), 90, "the planner healthy")
        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 60, "the worker registered")
        for k in range(3):  # traffic the planner sizes from (its ISL / OSL), then idle
            client.completions.create(model=MODEL, prompt=f"hello {k}", max_tokens=8)
        await until(lambda: _async(is_sleeping(worker.port)), 90, "the idle worker put to sleep")
        await until(lambda: _async(instances_of(frontend, MODEL) == 0), 30, "the frontend sees it gone")
        assert worker.alive()

        with pytest.raises(openai.APIStatusError) as asleep:
            client.completions.create(model=MODEL, prompt="wake up", max_tokens=8)
        assert asleep.value.status_code == 503 and asleep.value.body["code"] == "model_asleep"
        assert int(asleep.value.response.headers["retry-after"]) >= 1

        await until(lambda: _async(instances_of(frontend, MODEL) == 1), 30, "the worker woken on demand")
        reply = client.completions.create(model=MODEL, prompt="wake up", max_tokens=8,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8
        assert not is_sleeping(worker.port)
        log_text = planner.log_tail(400)
        assert "demand: 1 request(s) found every worker asleep; waking agg" in log_text
        assert "(woken 1, starting 0)" in log_text
        assert not list(spawned.glob("*.log"))  # nothing started: the wake was the only way up
        assert 'turbine_planner_decisions_total{direction="up",path="demand",role="agg"} 1.0' in \
            http_text(f"{planner.url}/metrics")
    finally:
        client.close()
        assert planner.stop() == 0
        worker.stop()

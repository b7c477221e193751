"""The global router (issue 33, §6): one frontend over two deployments of simulated workers, in two
namespaces of two different discoveries (`--pool east=east --pool west=west@file:DIR`), driven with the
official openai client: requests split between the pools by load; a whole pool SIGKILLed mid-run, its
streams continue on the other pool (migration) and no request is lost; per-pool metrics and /health
show it."""

from __future__ import annotations

import signal
import threading

import pytest
from openai import OpenAI

from tests.integration.procs import base_env, http_json, http_text, start_frontend, start_mocker, stop_all, wait_until
from tests.integration.procs import worker_ready
from tests.integration.test_migration_mocker import MOCKER, Stream, streaming
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL


def pool_series(frontend, name: str) -> dict[str, float]:
    out = {}
    for line in http_text(f"{frontend.url}/metrics").splitlines():
        if line.startswith(name + "{"):
            out[line.split('pool="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    root = tmp_path_factory.mktemp("global-router")
    east_env = base_env(str(root / "discovery-east"))
    west_env = base_env(str(root / "discovery-west"))  # another deployment: a discovery of its own
    east = start_mocker("east", {**east_env, "TURBINE_NAMESPACE": "east"}, root, *MOCKER, "--num-workers", "2")
    west = start_mocker("west", {**west_env, "TURBINE_NAMESPACE": "west"}, root, *MOCKER, "--num-workers", "2")
    router = start_frontend("global-router", east_env, root, "--pool", "east=east",
                            "--pool", f"west=west@file:{root / 'discovery-west'}", "--router-mode", "kv",
                            "--migration-limit", "3")
    procs = [east, west, router]
    try:
        wait_until(lambda: worker_ready(east) and worker_ready(west), 60, "both pools ready", procs)
        wait_until(lambda: http_json(f"{router.url}/health")[1].get("pools", {}).get(MODEL) == {"east": 2, "west": 2},
                   30, "the global router sees both pools", procs)
        yield {"east": east, "west": west, "router": router, "procs": procs}
    finally:
        stop_all(procs)


def test_requests_split_between_the_pools_by_load(pools):
    router = pools["router"]
    before = pool_series(router, "turbine_frontend_pool_requests_total")
    client = OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    results: list[int] = []

    def ask(i: int) -> None:  # prompts that share no prefix: only the load tells the pools apart
        r = client.completions.create(model=MODEL, prompt=f"Question number {i} about {i * 7919} things?",
                                      max_tokens=40, extra_body={"ignore_eos": True})
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [40] * 24
    after = pool_series(router, "turbine_frontend_pool_requests_total")
    routed = {pool: after.get(pool, 0) - before.get(pool, 0) for pool in ("east", "west")}
    assert sum(routed.values()) == 24
    assert min(routed.values()) >= 6, routed  # both pools took a share of the concurrent load
    assert pool_series(router, "turbine_frontend_pool_workers") == {"east": 2, "west": 2}


def test_a_pool_that_dies_mid_run_fails_over_and_nothing_is_lost(pools):
    router, west = pools["router"], pools["west"]
    prompt_tokens = OpenAI(base_url=f"{router.url}/v1", api_key="x").completions.create(
        model=MODEL, prompt="Tell me a story about a lighthouse keeper.", max_tokens=1).usage.prompt_tokens
    streams = [Stream(router) for _ in range(8)]
    streaming(streams, pools["procs"])
    on_west = sum(1 for line in http_text(f"{west.url}/metrics").splitlines()
                  if line.startswith("turbine_worker_inflight_requests{") and float(line.rsplit(" ", 1)[1]) > 0)
    assert on_west >= 1  # the pool about to die serves some of them
    west.stop(signal.SIGKILL)  # the whole pool: both its workers
    for s in streams:
        s.assert_unbroken(prompt_tokens)  # every stream completes, whole, with one id: nothing lost
    wait_until(lambda: http_json(f"{router.url}/health")[1]["pools"][MODEL] == {"east": 2, "west": 0}, 30,
               "the router sees the pool gone", [router])
    assert pool_series(router, "turbine_frontend_pool_workers") == {"east": 2, "west": 0}
    text = http_text(f"{router.url}/metrics")
    migrated = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("turbine_frontend_migrations_total{") and 'reason="disconnected"' in line)
    assert migrated >= 1
    # New requests go to the live pool only.
    before = pool_series(router, "turbine_frontend_pool_requests_total")
    client = OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    for i in range(4):
        r = client.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    after = pool_series(router, "turbine_frontend_pool_requests_total")
    assert after["east"] - before.get("east", 0) == 4 and after.get("west", 0) == before.get("west", 0)

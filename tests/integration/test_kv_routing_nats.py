"""KV-aware routing with the nats event plane (a real NATS server: $TURBINE_TEST_NATS, default
nats://127.0.0.1:4222), on simulated workers; a frontend that starts after the workers cached
blocks learns them from the workers (recovery, over the request plane) before it routes anything. On
both request planes (`plane`: TCP, and NATS too)."""

from __future__ import annotations


import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    free_port,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
WORKERS = 2
SYSTEM = "You are a careful assistant who answers briefly. " * 30  # several 16-token blocks


@pytest.fixture(scope="module", params=["tcp", "nats"])
def plane(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, nats_url, plane):
    root = tmp_path_factory.mktemp(f"kv-nats-{plane}")
    env = {**base_env(str(root / "discovery")), "TURBINE_REQUEST_PLANE": plane, "TURBINE_NATS_SERVER": nats_url}
    mockers = start_mocker("nats-mockers", env, root, "--num-workers", str(WORKERS), "--speedup-ratio", "0",
                           "--block-size", "16", "--event-plane", "nats", "--nats-server", nats_url)
    kv = start_frontend("nats-kv-frontend", env, root, "--router-mode", "kv")
    procs = [mockers, kv]
    try:
        wait_until(lambda: worker_ready(mockers), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(kv, MODEL) == WORKERS, 30, "frontend sees the fleet", procs)
        yield {"kv": kv, "env": env, "root": root, "procs": procs}
    finally:
        stop_all(procs)


def ask(frontend, question: str) -> int:
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return r.usage.prompt_tokens_details.cached_tokens


def test_workers_publish_over_nats_and_the_kv_router_follows(fleet, nats_url):
    cards = b"".join(p.read_bytes() for p in (fleet["root"] / "discovery").rglob("k.*"))
    assert f"{nats_url}/turbine.events.".encode() in cards  # the workers announce NATS subjects
    ask(fleet["kv"], "First question?")
    cached = [ask(fleet["kv"], f"Follow-up {i}?") for i in range(3)]
    assert all(c >= 16 * 10 for c in cached), cached  # routed to the worker holding the prefix
    text = http_text(f"{fleet['kv'].url}/metrics")
    assert metric(text, "turbine_router_indexed_blocks") > 0
    assert metric(text, "turbine_router_kv_event_gaps_total") == 0


def test_a_late_frontend_recovers_the_cache_and_routes_by_it(fleet):
    ask(fleet["kv"], "Warm the cache, please.")  # some worker holds the system prompt now
    late = start_frontend("nats-late-frontend", fleet["env"], fleet["root"], "--router-mode", "kv")
    try:
        wait_until(lambda: instances_of(late, MODEL) == WORKERS, 30, "late frontend sees the fleet", [late])
        # No request went through it, no event since: its index comes from the workers.
        wait_until(lambda: metric(http_text(f"{late.url}/metrics"), "turbine_router_indexed_blocks") > 0, 10,
                   "late frontend's index filled", [late])
        text = http_text(f"{late.url}/metrics")
        assert metric(text, "turbine_router_kv_event_recoveries_total") >= 1
        assert metric(text, "turbine_router_kv_event_recovery_failures_total") == 0
        assert ask(late, "A question for the late one?") >= 16 * 10
    finally:
        late.stop()


def test_an_unreachable_nats_server_stops_the_worker_naming_the_flag(fleet):
    url = f"nats://127.0.0.1:{free_port()}"
    proc = start_mocker("no-nats-mocker", fleet["env"], fleet["root"], "--event-plane", "nats",
                        "--nats-server", url)
    try:
        assert proc.popen.wait(60) == 2
        assert f"--nats-server: cannot reach the NATS server {url}" in proc.log_path.read_text()
    finally:
        proc.stop()

"""Metrics that add up (issue 33, §2), with real processes on simulated workers:
- a frontend of 2 processes (--frontend-processes 2, Prometheus multiprocess mode) beside a frontend
  of 1, 40 requests each on fresh connections: every scrape of the 2-process frontend, whichever process
  answers it, counts all 40 (counters and histograms summed, gauges combined, no series per process),
  and the planner's interval read from it equals the one-process frontend's;
- a worker's KV gauges per data-parallel rank (total, active, usage), and its model-load time, set at
  the engine's build and again by a wake from a level-2 sleep.
(The vLLM worker's usage gauge equals vLLM's own during a request: test_abandoned_requests.py.)"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.planner.observe import FrontendScraper

MODEL = "metrics-model"
REQUESTS = 40
MAX_TOKENS = 8


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(text: str, name: str, **labels: str) -> float:
    return sum(s.value for s in samples(text)
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def fresh_get(url: str) -> str:
    """One GET on a connection of its own (the kernel gives it to any of the frontend's processes)."""
    with httpx.Client(timeout=10) as client:
        return client.get(url).text


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-add-up")
    env = base_env(str(root / "discovery"))
    mocker = start_mocker("mocker", env, root, "--served-model-name", MODEL, "--speedup-ratio", "0")
    two = start_frontend("frontend-2", env, root, "--frontend-processes", "2")
    one = start_frontend("frontend-1", env, root)
    procs = [mocker, two, one]
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(one, MODEL) == 1 and all(instances_of(two, MODEL) == 1 for _ in range(8)),
                   120, "the model in every frontend process", procs)
        yield {"two": two, "one": one, "env": env, "root": root}
    finally:
        stop_all(procs)


def ask(frontend, i: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count the waves."}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": i % 2 == 1}
    with httpx.Client(timeout=30) as client:  # a new connection per request
        r = client.post(f"{frontend.url}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def test_every_scrape_of_several_processes_counts_every_request_and_the_planner_sees_them_all(stack):
    two, one = stack["two"], stack["one"]

    async def planner_intervals():
        scrapers = [FrontendScraper(f.url, MODEL) for f in (two, one)]
        for s in scrapers:
            await s.start()
        await asyncio.gather(*(asyncio.to_thread(ask, f, i) for f in (two, one) for i in range(REQUESTS)))
        observed = [await s.observe(0) for s in scrapers]
        for s in scrapers:
            await s.close()
        return observed

    multi, single = asyncio.run(planner_intervals())
    assert multi.requests == single.requests == REQUESTS
    assert (multi.isl, multi.osl) == (single.isl, single.osl) and multi.osl == MAX_TOKENS
    assert multi.kv_hit_rate == single.kv_hit_rate

    for _ in range(10):  # each scrape on a fresh connection: either process may answer
        text = fresh_get(f"{two.url}/metrics")
        assert total(text, "turbine_frontend_requests_total", model=MODEL, status="200") == REQUESTS
        assert total(text, "turbine_frontend_input_sequence_tokens_count", model=MODEL) == REQUESTS
        assert total(text, "turbine_frontend_output_tokens_total", model=MODEL) == REQUESTS * MAX_TOKENS
        assert total(text, "turbine_frontend_time_to_first_token_seconds_count", model=MODEL) == REQUESTS
        assert total(text, "turbine_frontend_inflight_requests", model=MODEL) == 0  # summed over live processes
        series = [(s.name, tuple(sorted(s.labels.items()))) for s in samples(text)]
        assert len(series) == len(set(series)), "a series is repeated"
        assert not any("pid" in dict(labels) for _, labels in series), "a series per process"


def test_the_metric_files_go_with_the_frontend(stack):
    """The multiprocess directory the parent made is removed when it stops."""
    frontend = start_frontend("frontend-tmp", stack["env"], stack["root"], "--frontend-processes", "2")
    try:
        wait_until(lambda: all(instances_of(frontend, MODEL) == 1 for _ in range(6)), 120, "both processes",
                   [frontend])
        import psutil

        child = next(c for c in psutil.Process(frontend.popen.pid).children() if "spawn_main" in " ".join(c.cmdline()))
        directory = child.environ()["PROMETHEUS_MULTIPROC_DIR"]
        import os

        assert os.path.isdir(directory) and any(name.endswith(".db") for name in os.listdir(directory))
    finally:
        frontend.stop()
    assert not os.path.exists(directory)


# --------------------------------------------------------------------------- a worker's KV gauges and load time
def post(url: str, body: dict | None = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status


def rank_values(text: str, name: str) -> dict[str, float]:
    return {s.labels["dp_rank"]: s.value for s in samples(text) if s.name == name}


def test_kv_gauges_per_rank_and_the_model_load_time(stack):
    root, env = stack["root"], stack["env"]
    worker = start_mocker("ranked", env, root, "--served-model-name", "ranked-model", "--data-parallel-size", "2",
                          "--startup-time", "1.5", "--num-gpu-blocks", "64", "--block-size", "16", "--max-model-len", "1024",
                          "--speedup-ratio", "0.05")
    frontend = start_frontend("ranked-frontend", env, root, "--router-mode", "kv")
    try:
        wait_until(lambda: worker_ready(worker), 60, "ranked mocker ready", [worker, frontend])
        wait_until(lambda: instances_of(frontend, "ranked-model") == 1, 30, "frontend sees it", [worker, frontend])
        text = http_text(f"{worker.url}/metrics")
        assert rank_values(text, "turbine_worker_total_kv_blocks") == {"0": 64, "1": 64}
        assert rank_values(text, "turbine_worker_active_kv_blocks") == {"0": 0, "1": 0}
        load_s = total(text, "turbine_worker_model_load_seconds")
        assert load_s >= 1.5  # the engines' build, with the simulated start-up

        # A slow request on one rank: that rank's gauges show it, the other's do not.
        done = threading.Event()

        def long_request():
            httpx.post(f"{frontend.url}/v1/completions", timeout=120, json={
                "model": "ranked-model", "prompt": "word " * 100, "max_tokens": 20, "ignore_eos": True})
            done.set()

        threading.Thread(target=long_request, daemon=True).start()
        busy: dict[str, float] = {}

        def one_rank_busy() -> bool:
            nonlocal busy
            text = http_text(f"{worker.url}/metrics")
            busy = rank_values(text, "turbine_worker_active_kv_blocks")
            return sorted(v > 0 for v in busy.values()) == [False, True]

        wait_until(one_rank_busy, 30, "one rank holding blocks", [worker])
        text = http_text(f"{worker.url}/metrics")
        active = rank_values(text, "turbine_worker_active_kv_blocks")
        usage = rank_values(text, "turbine_worker_kv_cache_usage_perc")
        assert usage == {rank: blocks / 64 for rank, blocks in active.items()}
        assert done.wait(120)

        # A level-2 sleep and a wake: the "reload" is timed again (the mocker has no weights: quick).
        assert post(f"{worker.url}/engine/sleep", {"level": 2}) == 200
        assert rank_values(http_text(f"{worker.url}/metrics"), "turbine_worker_total_kv_blocks") == {"0": 0, "1": 0}
        assert post(f"{worker.url}/engine/wake_up") == 200
        text = http_text(f"{worker.url}/metrics")
        reloaded = total(text, "turbine_worker_model_load_seconds")
        assert 0 <= reloaded < load_s and rank_values(text, "turbine_worker_total_kv_blocks") == {"0": 64, "1": 64}
        # A level-1 sleep keeps the weights: the load time stays.
        assert post(f"{worker.url}/engine/sleep", {"level": 1}) == 200
        assert post(f"{worker.url}/engine/wake_up") == 200
        assert total(http_text(f"{worker.url}/metrics"), "turbine_worker_model_load_seconds") == reloaded
    finally:
        stop_all([frontend, worker])

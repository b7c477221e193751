"""Loud failure for KV events that do not come: a worker whose card announces KV events but
whose events never arrive, or stop arriving, is named in a warning and counted in
turbine_router_kv_event_warnings_total{kind=...}; a healthy worker is not. The broken workers
are real simulated workers started with the --kv-events-drop-after test hook (they announce a
publisher and drop their events), served to a real kv-mode frontend."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)

DEADLINE_S = 2
MODELS = {"healthy": None, "silent": "0", "stalling": "1"}  # served model -> --kv-events-drop-after


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-event-warnings")
    env = base_env(str(root / "discovery"))
    mockers = {}
    for name, drop_after in MODELS.items():
        hook = ["--kv-events-drop-after", drop_after] if drop_after is not None else []
        mockers[name] = start_mocker(f"{name}-mocker", env, root, "--served-model-name", name, "--speedup-ratio",
                                     "0", "--block-size", "16", *hook)
    frontend = start_frontend("kv-frontend", env, root, "--router-mode", "kv", "--router-kv-events-deadline",
                              str(DEADLINE_S))
    procs = [*mockers.values(), frontend]
    try:
        wait_until(lambda: all(worker_ready(m) for m in mockers.values()), 60, "mockers ready", procs)
        wait_until(lambda: all(instances_of(frontend, name) == 1 for name in MODELS), 30, "frontend sees them",
                   procs)
        yield frontend
    finally:
        stop_all(procs)


def warnings_of(frontend, model: str, kind: str) -> float:
    total = 0.0
    for line in http_text(f"{frontend.url}/metrics").splitlines():
        if (line.startswith("turbine_router_kv_event_warnings_total{") and f'model="{model}"' in line
                and f'kind="{kind}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ask(frontend, model: str, topic: str) -> None:
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    # Long enough for several full 16-token blocks the router has not seen.
    client.completions.create(model=model, prompt=f"{topic}: " + "a long and winding story " * 30, max_tokens=2)


def log_of(frontend) -> str:
    return frontend.log_path.read_text(errors="replace")


def test_a_worker_whose_events_never_arrive_is_named(fleet):
    ask(fleet, "silent", "first")
    wait_until(lambda: warnings_of(fleet, "silent", "none_arrived") == 1, 15, "the none_arrived warning", [fleet])
    assert "KV events expected but none arrived in 2s" in log_of(fleet)


def test_a_worker_whose_events_stop_is_named(fleet):
    ask(fleet, "stalling", "first")  # its first event batch still goes out
    wait_until(lambda: metric(http_text(f"{fleet.url}/metrics"), "turbine_router_kv_events_applied_total") >= 1, 15,
               "its first events indexed", [fleet])
    time.sleep(1.5)  # the watchdog has seen them
    ask(fleet, "stalling", "second")  # new blocks, but no events any more
    wait_until(lambda: warnings_of(fleet, "stalling", "stopped") == 1, 15, "the stopped warning", [fleet])
    assert "KV events stopped: none in 2s" in log_of(fleet)


def test_a_healthy_worker_raises_no_warning(fleet):
    for topic in ("one", "two", "three"):
        ask(fleet, "healthy", topic)
    time.sleep(DEADLINE_S + 2)
    assert warnings_of(fleet, "healthy", "none_arrived") == warnings_of(fleet, "healthy", "stopped") == 0

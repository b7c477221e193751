"""KV-aware routing (approximate mode) through the real frontend, on a simulated fleet whose
workers report the prefix-cache hits they really had."""

from __future__ import annotations

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
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
WORKERS = 4
SYSTEM = "You are a meticulous assistant. " * 40  # a long shared system prompt (several blocks)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-routing")
    env = base_env(str(root / "discovery"))
    mockers = start_mocker("kv-mockers", env, root, "--num-workers", str(WORKERS), "--speedup-ratio", "0",
                           "--block-size", "16")
    kv = start_frontend("kv-frontend", env, root, "--router-mode", "kv")
    approx = start_frontend("approx-frontend", env, root, "--router-mode", "kv", "--no-router-kv-events")
    rr = start_frontend("rr-frontend", env, root, "--router-mode", "round-robin")
    procs = [mockers, kv, approx, rr]
    try:
        wait_until(lambda: worker_ready(mockers), 60, "mockers ready", procs)
        wait_until(lambda: all(instances_of(f, MODEL) == WORKERS for f in (kv, approx, rr)), 30,
                   "frontends see the fleet", procs)
        yield {"kv": kv, "approx": approx, "rr": rr, "env": env, "root": root}
    finally:
        stop_all(procs)


def indexed_blocks(frontend) -> float:
    return metric(http_text(f"{frontend.url}/metrics"), "turbine_router_indexed_blocks")


def cached_tokens_of_followups(frontend, tag: str, wait_for_events: bool = False) -> list[int]:
    """`wait_for_events`: the follow-ups wait until the router's index holds the first question's blocks
    (its worker's KV events arrive asynchronously: on a fast, idle host a follow-up could be routed first)."""
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)

    def ask(question):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "system", "content": tag + SYSTEM}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens

    before = indexed_blocks(frontend) if wait_for_events else 0
    ask("First question?")
    if wait_for_events:
        wait_until(lambda: indexed_blocks(frontend) - before >= 10, 20, "the first question's blocks indexed")
    return [ask(f"Follow-up number {i}?") for i in range(WORKERS)]


@pytest.mark.parametrize("mode", ["kv", "approx"])
def test_kv_router_sends_shared_prefixes_to_the_worker_that_has_them(fleet, mode):
    # kv: the index follows the workers' KV events; approx: the router's own decisions.
    cached = cached_tokens_of_followups(fleet[mode], f"{mode} ", wait_for_events=mode == "kv")
    assert all(c >= 16 * 10 for c in cached), cached  # the shared system prompt: 10+ full blocks


def test_round_robin_does_not(fleet):
    # The control: the same traffic spread round-robin mostly misses the cache.
    cached = cached_tokens_of_followups(fleet["rr"], "rr ")
    assert sum(c == 0 for c in cached) >= WORKERS - 1, cached


def test_worker_without_kv_events_is_reported_loudly(fleet):
    # A worker that publishes no events (prefix caching off) is named in a warning: the kv
    # router does not quietly pretend to see its cache.
    silent = start_mocker("silent-mocker", fleet["env"], fleet["root"], "--served-model-name", "silent",
                          "--speedup-ratio", "0", "--no-enable-prefix-caching")
    try:
        wait_until(lambda: instances_of(fleet["kv"], "silent") == 1, 60, "silent worker visible", [silent])
        wait_until(lambda: "publishes no KV events" in fleet["kv"].log_path.read_text(errors="replace"), 10,
                   "the warning", [])
    finally:
        silent.stop()


def test_router_metrics(fleet):
    from tests.integration.procs import http_text, metric

    cached_tokens_of_followups(fleet["kv"], "metrics ")
    text = http_text(f"{fleet['kv'].url}/metrics")
    assert metric(text, "turbine_router_decisions_total") >= WORKERS + 1
    assert metric(text, "turbine_router_indexed_blocks") > 0  # learned from the workers' events
    assert metric(text, "turbine_router_kv_events_applied_total") > 0
    assert metric(text, "turbine_router_kv_event_gaps_total") == 0
    assert "turbine_router_decision_seconds_bucket" in text and "turbine_router_overlap_ratio_bucket" in text

"""A client that gives up before its answer is complete (issue 33, §5): tried as a user would, with the
official `openai` client and a short timeout on a long request, streamed or not, on every generation
endpoint. The frontend notices the client leaving, the engine request is aborted (the workers' running
count and KV blocks in use back to 0 within 2 s), and both sides count it. Real vLLM CPU workers (the
session's cluster: tests/integration/conftest.py)."""

from __future__ import annotations

import time

import openai
import pytest

from tests.integration.conftest import MODEL
from tests.integration.procs import http_text, metric, wait_until

LONG = 1900  # tokens the request would take (max_model_len 2048): minutes on a CPU engine
CLIENT_TIMEOUT_S = 3.0
ABORTED_WITHIN_S = 2.0  # the bound, from the client's timeout to an idle engine


def _sample(cluster) -> dict[str, float]:
    workers = [http_text(f"{w.url}/metrics") for w in cluster["workers"]]
    frontend = http_text(f"{cluster['frontend'].url}/metrics")
    return {
        "running": sum(metric(t, "vllm:num_requests_running") for t in workers),
        "usage": sum(metric(t, "vllm:kv_cache_usage_perc") for t in workers),
        "unfinished": sum(metric(t, "turbine_worker_engine_unfinished_requests") for t in workers),
        "cancellations": sum(metric(t, "turbine_worker_cancellations_total") for t in workers),
        "disconnects": metric(frontend, "turbine_frontend_disconnected_clients_total"),
        "left": sum(float(line.rsplit(" ", 1)[1]) for line in frontend.splitlines()
                    if line.startswith("turbine_frontend_requests_total{") and 'status="499"' in line),
    }


def _give_up(client, endpoint: str, stream: bool, base_url: str) -> None:
    """The request, given up on: whole, by a client that stops waiting after CLIENT_TIMEOUT_S; streamed,
    by one that closes the stream after a few events (a stream's reads do not time out while it flows)."""
    if endpoint == "messages":  # Anthropic's Messages API, through the official anthropic client
        import anthropic

        messages = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0,
                                       timeout=CLIENT_TIMEOUT_S).messages
        ask = dict(model=MODEL, max_tokens=LONG, messages=[{"role": "user", "content": "Tell me a very long story."}])
        if not stream:
            with pytest.raises(anthropic.APITimeoutError):
                messages.create(**ask)
            return
        events = messages.create(**ask, stream=True)
        for i, _ in enumerate(events):
            if i == 4:
                break
        events.close()
        return
    impatient = client.with_options(timeout=CLIENT_TIMEOUT_S, max_retries=0)
    extra = {"ignore_eos": True}

    def create():
        if endpoint == "chat":
            return impatient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story."}],
                max_tokens=LONG, temperature=0, stream=stream, extra_body=extra)
        if endpoint == "completions":
            return impatient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG,
                                                temperature=0, stream=stream, extra_body=extra)
        if endpoint == "batch":  # two prompts, each its own worker request
            return impatient.completions.create(model=MODEL, prompt=["Once upon a time", "A long time ago"],
                                                max_tokens=LONG, temperature=0, stream=stream, extra_body=extra)
        return impatient.responses.create(model=MODEL, input="Tell me a very long story.",
                                          max_output_tokens=LONG, temperature=0, stream=stream)

    if not stream:
        with pytest.raises(openai.APITimeoutError):
            create()
        return
    events = create()
    for i, _ in enumerate(events):
        if i == 4:
            break
    events.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions", "batch", "responses", "messages"])
def test_a_client_that_gives_up_has_its_engine_requests_aborted(client, cluster, endpoint, stream):
    # Idle to start with. A worker's start-up canary (or one a /health probe ran) may still be finishing when the
    # session's cluster has just come up: CI saw `unfinished` 1 at the first case's start.
    idle = lambda: (s := _sample(cluster))["running"] == 0 and s["unfinished"] == 0  # noqa: E731
    wait_until(idle, 10, "the cluster's engines idle", cluster["workers"])
    before = _sample(cluster)
    _give_up(client, endpoint, stream, cluster["frontend"].url)
    gave_up = time.monotonic()
    while True:
        now = _sample(cluster)
        if now["running"] == 0 and now["unfinished"] == 0 and now["usage"] == 0:
            break
        assert time.monotonic() - gave_up < ABORTED_WITHIN_S, f"still generating: {now}"
        time.sleep(0.05)
    requests = 2 if endpoint == "batch" else 1
    assert now["cancellations"] - before["cancellations"] == requests  # the workers aborted them
    assert now["disconnects"] - before["disconnects"] == 1  # the frontend saw the client leave
    if not stream:  # a stream had answered 200 already; an unanswered request is logged and counted as 499
        assert now["left"] - before["left"] == 1
    # The workers serve on: a short request right after.
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_the_workers_kv_gauges_equal_vllms_during_a_request(client, cluster):
    """Issue 33, §2: per rank, the blocks in use and the usage share the worker exports are vLLM's own
    (the usage is vllm:kv_cache_usage_perc, to the digit), and the model's load time is known."""
    from prometheus_client.parser import text_string_to_metric_families

    def rank0(text: str, name: str) -> float:
        [value] = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and s.labels.get("dp_rank", s.labels.get("engine")) == "0"]
        return value

    stream = client.completions.create(model=MODEL, prompt="Once upon a time " * 20, max_tokens=LONG,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        seen = None
        deadline = time.monotonic() + 30
        while seen is None and time.monotonic() < deadline:
            for w in cluster["workers"]:
                text = http_text(f"{w.url}/metrics")
                usage = rank0(text, "turbine_worker_kv_cache_usage_perc")
                if usage > 0:
                    seen = (text, usage)
                    break
            time.sleep(0.1)
        assert seen is not None, "no worker showed the request's blocks"
        text, usage = seen
        assert usage == rank0(text, "vllm:kv_cache_usage_perc")
        total = rank0(text, "turbine_worker_total_kv_blocks")
        assert rank0(text, "turbine_worker_active_kv_blocks") == round(usage * (total - 1)) > 0
        assert metric(text, "turbine_worker_model_load_seconds") > 0
    finally:
        stream.close()

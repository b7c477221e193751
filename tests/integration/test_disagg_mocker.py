"""Disaggregated serving through the real frontend on simulated workers: prefill workers are
chosen by the KV router from their caches, decode workers get the KV's location and report
the pulled prompt as cached, and the answer is the same as an aggregated worker's."""

from __future__ import annotations

import zlib

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    prefill_workers_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 30  # many 16-token blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg-mocker")
    env = base_env(str(root / "discovery"))
    common = ["--speedup-ratio", "0", "--block-size", "16"]
    prefill = start_mocker("prefill-mockers", env, root, "--num-workers", "3", "--is-prefill-worker", *common)
    decode = start_mocker("decode-mocker", env, root, "--is-decode-worker", *common)
    agg = start_mocker("agg-mocker", env, root, "--served-model-name", "agg", *common)
    frontend = start_frontend("frontend", env, root, "--router-mode", "kv", "--max-local-prefill-length", "64")
    procs = [prefill, decode, agg, frontend]
    try:
        wait_until(lambda: all(worker_ready(p) for p in (prefill, decode, agg)), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1 and instances_of(frontend, "agg") == 1
                   and prefill_workers_of(frontend, MODEL) == 3,
                   30, "the frontend sees 3 prefill workers and the decode worker", procs)
        yield {"frontend": frontend, "prefill": prefill, "decode": decode}
    finally:
        stop_all(procs)


def unique(question: str) -> str:
    """The question with a long part of its own: more than --max-local-prefill-length (64)
    tokens that no worker has cached, so it is prefilled remotely even where the system
    prompt is cached on the decode worker."""
    tag = zlib.crc32(question.encode())
    return question + " " + " ".join(f"detail{tag}x{k}" for k in range(40))


def remote_prefills(frontend) -> float:
    lines = [line for line in http_text(f"{frontend.url}/metrics").splitlines()
             if line.startswith("turbine_frontend_prefills_total") and 'where="remote"' in line]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def ask(frontend, model: str, question: str):
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_prefills_go_to_the_prefill_worker_that_has_the_prefix(fleet):
    frontend = fleet["frontend"]
    first = ask(frontend, MODEL, "What is the first question?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached anywhere yet
    # Every follow-up shares the long system prompt: the KV router picks the one prefill worker
    # (of three) that computed it, which reports those blocks as cached.
    wait_until(lambda: metric(http_text(f"{frontend.url}/metrics"), "turbine_router_indexed_blocks") >= 10, 10,
               "the prefill worker's blocks indexed", [frontend])
    follow_ups = [ask(frontend, MODEL, unique(f"Follow-up number {i}?")) for i in range(4)]
    assert all(r.usage.prompt_tokens_details.cached_tokens >= 16 * 20 for r in follow_ups), \
        [r.usage.prompt_tokens_details.cached_tokens for r in follow_ups]
    assert remote_prefills(frontend) == 5


def test_prompt_cached_on_the_decode_worker_is_prefilled_there(fleet):
    """The decode worker served the system prompt before: a question that adds fewer than 64
    new tokens to it is prefilled on the decode worker, which reports the prefix as cached."""
    frontend = fleet["frontend"]
    ask(frontend, MODEL, unique("Warm the decode worker."))
    before = remote_prefills(frontend)
    r = ask(frontend, MODEL, "A short one?")
    assert r.usage.prompt_tokens > 64 * 4 and r.usage.prompt_tokens_details.cached_tokens >= 16 * 20
    assert remote_prefills(frontend) == before


def test_disaggregated_answer_equals_aggregated(fleet):
    frontend = fleet["frontend"]
    for question in (unique("Tell me about rivers."), unique("And about mountains?")):
        before = remote_prefills(frontend)
        disagg, agg = ask(frontend, MODEL, question), ask(frontend, "agg", question)
        assert remote_prefills(frontend) == before + 1  # the KV was handed over
        assert disagg.choices[0].message.content == agg.choices[0].message.content
        assert disagg.usage.completion_tokens == agg.usage.completion_tokens == 12


def test_short_prompts_are_prefilled_on_the_decode_worker(fleet):
    frontend = fleet["frontend"]
    before = metric(http_text(f"{frontend.url}/metrics"), "turbine_frontend_prefills_total")
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=4)
    assert r.usage.prompt_tokens < 64 and r.choices[0].finish_reason == "length"
    assert metric(http_text(f"{frontend.url}/metrics"), "turbine_frontend_prefills_total") == before

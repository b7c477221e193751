"""Speculative decoding through Turbine's vLLM worker (issue #29, section 4), both kinds of speculator vLLM's
CPU build runs: the n-gram one (`--speculative-config '{"method": "ngram", ...}'`) and a draft model
(`{"method": "draft_model", "model": ...}`; the served model drafts for itself, the one real model at hand, so
its drafts are mostly accepted). Three workers of this module's own behind one KV-routing frontend with
migration on: two speculate (one each way) and serve the model, one with the same flags but no speculator
serves it under another name (the reference; same engine flags, since another block size or input path can
flip a near-tie between two tokens in a long greedy run):

- greedy answers (chat and completions, streamed and not) and their usage equal the plain engine's;
- vLLM's `vllm:spec_decode_*` counters reach each worker's /metrics, and both speculators' drafts were accepted;
- the KV events the worker relays name only verified blocks: a request leaves exactly the full blocks of
  its final sequence in the router's index (a block announced for rejected draft tokens would be one more,
  or another), and a request that continues a conversation is routed to the worker holding it;
- a speculative stream whose worker is SIGKILLed goes on on the other worker, unbroken (last: it ends one).

TURBINE_TEST_SPEC_CONFIG gives both speculating workers one config instead (e.g. another speculator on a GPU,
benchmarks/gpu/gpu_tests.sh)."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
BLOCK = 32
# Repetitive answers: the n-gram speculator finds its drafts in the context, so many are accepted.
PROMPTS = [
    "Repeat this line five times: the cat sat on the mat, the dog sat on the log.",
    "Count from one to twenty in words, separated by commas.",
    "Write the alphabet in capital letters, each letter followed by a dash.",
]
GREEDY = {"temperature": 0, "max_tokens": 48}
PLAIN = "plain-reference"


@pytest.fixture(scope="module")
def spec(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("speculative")
    env = base_env(str(root / "discovery"))
    # float32, as the session cluster on this host: a migrated continuation is prefilled where the unbroken
    # run decoded, and the parity below compares with engines that did not speculate.
    flags = ("--dtype", "float32", "--block-size", str(BLOCK))
    specs = [os.environ.get("TURBINE_TEST_SPEC_CONFIG")] * 2
    if specs[0] is None:
        specs = [json.dumps(NGRAM),
                 json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})]
    workers = [start_worker(f"spec-worker{i}", env, root, *flags, "--speculative-config", spec)
               for i, spec in enumerate(specs, 1)]
    plain = start_worker("plain-worker", env, root, *flags, "--served-model-name", PLAIN)
    frontend = start_frontend("spec-frontend", env, root, "--router-mode", "kv", "--migration-limit", "2")
    procs = [*workers, plain, frontend]
    try:
        wait_until(lambda: all(worker_ready(w) for w in (*workers, plain)), ENGINE_START_TIMEOUT, "workers ready",
                   procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2 and instances_of(frontend, PLAIN) == 1, 30,
                   "the frontend sees every worker", procs)
        yield {"workers": workers, "frontend": frontend,
               "client": OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=300)}
    finally:
        stop_all(procs)


def _answers(client: OpenAI, model: str) -> list:
    out = []
    for p in PROMPTS:
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], **GREEDY)
        out.append((chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.completion_tokens))
        pieces, usage = [], None
        for chunk in client.completions.create(model=model, prompt=p, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY):
            pieces += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        out.append(("".join(pieces), usage.prompt_tokens, usage.completion_tokens))
    return out


def test_greedy_answers_and_usage_equal_the_plain_engines(spec):
    assert _answers(spec["client"], MODEL) == _answers(spec["client"], PLAIN)


def _drafts(worker) -> tuple[float, float]:
    text = http_text(f"{worker.url}/metrics")
    return (metric(text, "vllm:spec_decode_num_draft_tokens_total"),
            metric(text, "vllm:spec_decode_num_accepted_tokens_total"))


def test_spec_decode_counters_reach_each_workers_metrics(spec):
    # Requests in pairs until both workers speculated: the router sends the second of two concurrent requests
    # to the worker the first did not load (equal load alone is a coin toss).
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            if all(_drafts(w)[0] > 0 for w in spec["workers"]):
                break
            list(pool.map(lambda p: spec["client"].completions.create(model=MODEL, prompt=p, **GREEDY), PROMPTS[:2]))
    for w in spec["workers"]:
        drafts, accepted = _drafts(w)
        assert drafts > 0 and 0 < accepted <= drafts, (w.name, drafts, accepted)


def _indexed(frontend) -> float:
    return metric(http_text(f"{frontend.url}/metrics"), "turbine_router_indexed_blocks")


def test_the_router_indexes_only_verified_blocks(spec):
    frontend, client = spec["frontend"], spec["client"]
    before = _indexed(frontend)
    prompt = "Say the days of the week in order, twice, one per line. " * 3
    r = client.completions.create(model=MODEL, prompt=prompt, **dict(GREEDY, max_tokens=120),
                                  extra_body={"ignore_eos": True})
    full = (r.usage.prompt_tokens + r.usage.completion_tokens - 1) // BLOCK  # the last token's KV is never computed
    wait_until(lambda: _indexed(frontend) - before >= full, 20, "the request's blocks indexed", [frontend])
    assert _indexed(frontend) - before == full
    # The conversation goes on where its blocks are: its whole first turn is cached.
    again = client.completions.create(model=MODEL, prompt=prompt + r.choices[0].text, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= (r.usage.prompt_tokens // BLOCK) * BLOCK


def test_a_speculative_stream_migrates_when_its_worker_is_killed(spec):
    """Last: it kills one of the module's workers."""
    frontend, workers = spec["frontend"], spec["workers"]
    prompt, tokens = "Write a long story about a lighthouse keeper and the sea.", 128
    greedy = dict(temperature=0, max_tokens=tokens, extra_body={"ignore_eos": True})
    reference = spec["client"].completions.create(model=PLAIN, prompt=prompt, **greedy)
    result = {"pieces": [], "error": None, "usage": None}

    def read():
        try:
            for chunk in spec["client"].completions.create(model=MODEL, prompt=prompt, stream=True,
                                                           stream_options={"include_usage": True}, **greedy):
                result["pieces"] += [c.text for c in chunk.choices]
                result["usage"] = chunk.usage or result["usage"]
        except Exception as exc:  # noqa: BLE001 - asserted below
            result["error"] = exc

    stream = threading.Thread(target=read, daemon=True)
    stream.start()
    wait_until(lambda: len(result["pieces"]) >= 4, 120, "the stream under way", workers)
    busy = lambda w: metric(http_text(f"{w.url}/metrics"), "turbine_worker_inflight_requests")  # noqa: E731
    victim = max(workers, key=busy)
    assert busy(victim) == 1 and stream.is_alive()
    victim.stop(signal.SIGKILL)
    stream.join(300)
    assert result["error"] is None, result["error"]
    assert "".join(result["pieces"]) == reference.choices[0].text
    assert result["usage"].completion_tokens == tokens
    assert metric(http_text(f"{frontend.url}/metrics"), "turbine_frontend_migrations_total") == 1

"""KV-aware routing over data-parallel ranks, through the real frontend: one simulated worker with
two engines (`--data-parallel-size 2`), each with its own KV cache. The router must pick the rank,
not only the instance: a burst of distinct prompts spreads over both ranks, and a prompt that
repeats a prefix goes to the rank holding it (else the worker's engine would miss its cache)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

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
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
BS = 16
PROMPTS = 8
SYSTEM = "You are a meticulous assistant who answers briefly. " * 20  # 10+ full blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-routing-dp")
    env = base_env(str(root / "discovery"))
    # Real-time pacing (speedup 1): the burst's requests overlap, so the router's own counts of what
    # it just sent steer it, as with real engines.
    mocker = start_mocker("dp-mocker", env, root, "--data-parallel-size", "2", "--speedup-ratio", "1",
                          "--block-size", str(BS))
    frontend = start_frontend("dp-kv-frontend", env, root, "--router-mode", "kv")
    procs = [mocker, frontend]
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "frontend sees the worker", procs)
        yield frontend
    finally:
        stop_all(procs)


def per_rank(text: str, name: str) -> dict[str, float]:
    """A per-worker router gauge by its worker label ("instance" for rank 0, "instance/RANK")."""
    out = {}
    for m in re.finditer(rf'^{name}{{[^}}]*worker="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_a_burst_spreads_over_both_ranks_and_repeats_go_to_the_rank_that_holds_them(fleet):
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)

    def ask(tag: int, question: str, max_tokens: int) -> int:
        r = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, messages=[
            {"role": "system", "content": f"Conversation {tag}. " + SYSTEM},
            {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens or 0

    # A burst of distinct prompts (no cached prefix anywhere): spread by load over both ranks.
    with ThreadPoolExecutor(PROMPTS) as pool:
        list(pool.map(lambda i: ask(i, "First question?", 16), range(PROMPTS)))
    wait_until(lambda: len([v for v in per_rank(http_text(f"{fleet.url}/metrics"),
                                                 "turbine_router_indexed_blocks").values() if v > 0]) == 2,
               10, "both ranks' KV events indexed")
    blocks = per_rank(http_text(f"{fleet.url}/metrics"), "turbine_router_indexed_blocks")
    assert len(blocks) == 2 and sum(1 for w in blocks if "/" in w) == 1, blocks  # "instance", "instance/1"
    total = sum(blocks.values())
    assert all(v >= total / 4 for v in blocks.values()), blocks  # neither rank got (nearly) all of it

    # Each prefix again, one at a time: it is served by the rank holding it, so the engine hits its
    # cache every time (half of them live on rank 1: a router that ignored ranks would miss those).
    cached = [ask(i, f"Follow-up {i}?", 4) for i in range(PROMPTS)]
    assert all(c >= BS * 10 for c in cached), cached

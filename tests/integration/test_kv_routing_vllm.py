"""KV-aware routing on the two real vLLM CPU workers of the session cluster, fed by the
engines' own KV cache events relayed by the workers."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
from openai import OpenAI

from tests.integration.conftest import MODEL
from tests.integration.procs import http_text, instances_of, metric, start_frontend, wait_until
from tests.integration.test_structured_outputs import RESPONSE_FORMAT, SCHEMA
from turbine.protocol.generate import ClearKvBlocksRequest, StatusReply
from turbine.runtime.request_plane import RequestPlaneClient

PREFIX = "Background: " + "The river flows past the old mill and the stone bridge. " * 45


@pytest.fixture(scope="module")
def kv_frontend(cluster):
    f = start_frontend("kv-frontend-vllm", cluster["env"], cluster["root"], "--router-mode", "kv")
    try:
        wait_until(lambda: instances_of(f, MODEL) == 2, 30, "kv frontend sees both workers", [f])
        yield f
    finally:
        f.stop()


def indexed_blocks(frontend) -> dict[str, float]:
    out = {}
    for line in http_text(f"{frontend.url}/metrics").splitlines():
        if line.startswith("turbine_router_indexed_blocks{"):
            worker = line.split('worker="')[1].split('"')[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def test_shared_prefix_goes_to_the_worker_that_cached_it(kv_frontend):
    client = OpenAI(base_url=f"{kv_frontend.url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask(q):
        r = client.completions.create(model=MODEL, prompt=PREFIX + q, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert ask("Question one?") == 0
    # The engine's BlockStored events reach the router's index.
    wait_until(lambda: sum(indexed_blocks(kv_frontend).values()) >= 4, 20, "blocks indexed", [kv_frontend])
    cached = [ask(f"Question {n}?") for n in ("two", "three", "four")]
    assert all(c >= 4 * 128 for c in cached), cached


def test_structured_outputs_through_the_kv_router(kv_frontend):
    """A constrained request routed by the KV router (on its templated prompt) still gets its
    constraint: the output validates against the schema."""
    client = OpenAI(base_url=f"{kv_frontend.url}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PREFIX + "Name a city and a number."}],
        max_tokens=40, temperature=0, response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_clear_kv_blocks_makes_the_index_forget_that_worker(kv_frontend, cluster):
    client = OpenAI(base_url=f"{kv_frontend.url}/v1", api_key="x", max_retries=0, timeout=120)
    client.completions.create(model=MODEL, prompt=PREFIX + "Anything?", max_tokens=2, temperature=0)
    wait_until(lambda: max(indexed_blocks(kv_frontend).values(), default=0) >= 4, 20, "blocks indexed",
               [kv_frontend])
    holder = max(indexed_blocks(kv_frontend).items(), key=lambda kv: kv[1])[0]

    async def clear():
        from turbine.config import DiscoveryConfig, make_registry

        registry = make_registry(DiscoveryConfig(file_dir=cluster["env"]["TURBINE_DISCOVERY_DIR"]))
        await registry.backend.start()
        rp = RequestPlaneClient()
        try:
            address = next(r.address for r in await registry.list_instances() if r.instance_id == holder)
            return [r async for r in rp.stream(address, "clear_kv_blocks", ClearKvBlocksRequest(), StatusReply)]
        finally:
            await rp.close()
            await registry.backend.close()

    for _ in range(20):  # refused while a request still runs there
        if asyncio.run(clear())[0].status == "success":
            break
        time.sleep(0.5)
    wait_until(lambda: indexed_blocks(kv_frontend).get(holder, 0) == 0, 20, "index forgot the worker",
               [kv_frontend])


def test_workers_report_their_load_from_vllms_stat_loggers(kv_frontend, cluster):
    # Each vLLM worker turns its engine's scheduler stats (vLLM's stat-logger hook) into load
    # reports on its event plane; the kv router follows them (shown per worker on /metrics).
    def reported_totals() -> dict[str, float]:
        out = {}
        for line in http_text(f"{kv_frontend.url}/metrics").splitlines():
            if line.startswith("turbine_router_worker_kv_total_blocks{"):
                out[line.split('worker="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return out

    wait_until(lambda: len(reported_totals()) == 2, 30, "load reports from both workers", [kv_frontend])
    # A running request holds blocks, and the report says so.
    client = OpenAI(base_url=f"{kv_frontend.url}/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=PREFIX + "Tell me more.", max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        wait_until(lambda: metric(http_text(f"{kv_frontend.url}/metrics"), "turbine_router_worker_kv_active_blocks")
                   >= 4, 20, "a busy worker reports its blocks", [kv_frontend])
    finally:
        stream.close()
    # Idle now: no blocks held by running requests (cached prefixes are evictable, not in use).
    wait_until(lambda: metric(http_text(f"{kv_frontend.url}/metrics"), "turbine_router_worker_kv_active_blocks")
               == 0, 20, "idle workers report no active blocks", [kv_frontend])
    for w in cluster["workers"]:
        text = http_text(f"{w.url}/metrics")
        assert "vllm:num_requests_running" in text  # vLLM's own stat loggers still run beside ours
        total = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("turbine_worker_total_kv_blocks{"))
        worker_id = next(line.split('worker_id="')[1].split('"')[0] for line in text.splitlines()
                         if line.startswith("turbine_worker_total_kv_blocks{"))
        assert reported_totals()[worker_id] == total > 0

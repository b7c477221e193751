"""Overload control end to end, on mocker processes behind real frontends, with the official
openai client: a worker past its bound refuses with `overloaded` and the frontend serves the
request on another worker; when every worker refuses, the client gets 503 with Retry-After and
an OpenAI-style body; the frontend's own bound does the same; refusals are counted on both
sides' /metrics and leave no KV blocks behind.

A worker is saturated on purpose: --max-num-seqs 1 and --max-waiting-requests 1, one long
streaming request running (it has its first token, so it no longer waits) and one short request
waiting behind it. Closing the long stream aborts it; the short one then runs and ends."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    wait_until,
    worker_ready,
)
from tests.integration.test_mocker_fleet import per_worker

ONE_SLOW = "overload-one-slow"  # a saturable worker and a fast one with the default bounds
ALL_SLOW = "overload-all-slow"  # two saturable workers
# One running sequence, one waiting; steps about 140 ms (real time x 5), so a long answer streams for minutes.
SATURABLE = ["--max-num-seqs", "1", "--max-waiting-requests", "1", "--speedup-ratio", "0.2"]
LONG, SHORT = 1500, 3  # max_tokens of the running request / of the waiting and the tested ones
RETRY_AFTER = 7  # the limited frontend's --overload-retry-after


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("overload")
    env = base_env(str(root / "discovery"))
    slow = start_mocker("overload-slow", env, root, "--served-model-name", ONE_SLOW, *SATURABLE)
    fast = start_mocker("overload-fast", env, root, "--served-model-name", ONE_SLOW, "--speedup-ratio", "0")
    pair = start_mocker("overload-pair", env, root, "--served-model-name", ALL_SLOW, "--num-workers", "2",
                        *SATURABLE)
    frontend = start_frontend("overload-frontend", env, root)
    limited = start_frontend("overload-frontend-limited", env, root, "--max-inflight-requests", "1",
                             "--overload-retry-after", str(RETRY_AFTER))
    procs = [slow, fast, pair, frontend, limited]
    try:
        wait_until(lambda: all(worker_ready(m) for m in (slow, fast, pair)), 90, "mockers ready", procs)
        wait_until(lambda: all(instances_of(f, ONE_SLOW) == 2 and instances_of(f, ALL_SLOW) == 2
                               for f in (frontend, limited)), 30, "frontends see every worker", procs)
        yield {"slow": slow, "fast": fast, "pair": pair, "frontend": frontend, "limited": limited}
    finally:
        for p in procs:
            p.stop()


def client_of(frontend) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)


def gauges(worker, name: str) -> dict[str, float]:
    return per_worker(http_text(f"{worker.url}/metrics"), name)


async def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def saturate(client: openai.AsyncOpenAI, model: str, worker, count: int):
    """Saturate `count` simulated workers of `worker`'s process: on each one long stream running
    and one short request waiting. Requests that land on another (fast) worker just finish.
    Returns the open streams and the waiting requests' tasks."""
    streams, waiting = [], []

    def on_each(name: str, value: float) -> bool:
        values = gauges(worker, name)
        return len(values) == count and all(v == value for v in values.values())

    while not on_each("turbine_worker_inflight_requests", 1):
        assert len(streams) < 4 * count, "round-robin should have reached every worker"
        stream = await client.completions.create(model=model, prompt="Tell me a long story", max_tokens=LONG,
                                                 stream=True, extra_body={"ignore_eos": True})
        await anext(aiter(stream))  # a first chunk: it runs
        streams.append(stream)
        await asyncio.sleep(0.3)  # a stream that landed on the fast worker has ended by now
    while not on_each("turbine_worker_waiting_requests", 1):
        assert len(waiting) < 4 * count, "round-robin should have reached every worker"
        waiting.append(asyncio.create_task(
            client.completions.create(model=model, prompt="A short one", max_tokens=SHORT)))
        await asyncio.sleep(0.5)
    return streams, waiting


async def release(streams, waiting, worker) -> None:
    """Close the long streams (their requests are aborted); the waiting requests then run and
    end; no block stays in use and nothing waits."""
    for stream in streams:
        await stream.close()
    for done in await asyncio.gather(*waiting):
        assert done.choices[0].finish_reason == "length"
    await wait_for(lambda: sum(gauges(worker, "turbine_mocker_kv_blocks_in_use").values()) == 0
                   and sum(gauges(worker, "turbine_worker_waiting_requests").values()) == 0,
                   "KV blocks and the queue back to their idle baseline")


async def test_a_worker_past_its_bound_refuses_and_another_serves_the_request(fleet):
    slow, frontend = fleet["slow"], fleet["frontend"]
    client = client_of(frontend)
    streams, waiting = await saturate(client, ONE_SLOW, slow, 1)
    refused_before = metric(http_text(f"{slow.url}/metrics"), "turbine_worker_overload_rejections_total")
    # Round-robin over two workers: of any two requests in a row, one is offered to the slow worker first.
    for i in range(4):
        reply = await client.completions.create(model=ONE_SLOW, prompt=f"Question {i}", max_tokens=SHORT)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == SHORT
    refused = metric(http_text(f"{slow.url}/metrics"), "turbine_worker_overload_rejections_total") - refused_before
    assert refused >= 1
    front = http_text(f"{frontend.url}/metrics")
    assert metric(front, "turbine_frontend_worker_overloaded_refusals_total") >= refused
    assert metric(front, "turbine_frontend_overloaded_rejections_total") == 0  # nobody got a 503
    await release(streams, waiting, slow)
    await client.close()


async def test_every_worker_saturated_is_a_503_with_retry_after(fleet):
    pair, frontend = fleet["pair"], fleet["frontend"]
    client = client_of(frontend)
    streams, waiting = await saturate(client, ALL_SLOW, pair, 2)
    before = metric(http_text(f"{frontend.url}/metrics"), "turbine_frontend_overloaded_rejections_total")
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=ALL_SLOW, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=SHORT, stream=stream)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"  # the default --overload-retry-after
        error = info.value.body
        assert (error["type"], error["code"]) == ("service_unavailable", "overloaded")
        assert ALL_SLOW in error["message"] and "overloaded" in error["message"]
    front = http_text(f"{frontend.url}/metrics")
    assert metric(front, "turbine_frontend_overloaded_rejections_total") - before == 2
    # Each 503 was refused by both workers, each worker counting its own.
    refusals = gauges(pair, "turbine_worker_overload_rejections_total")
    assert len(refusals) == 2 and all(v >= 2 for v in refusals.values())
    await release(streams, waiting, pair)
    await client.close()


async def test_the_frontend_bound_refuses_with_retry_after(fleet):
    limited = fleet["limited"]
    body_may_end = asyncio.Event()

    async def slow_body():
        await body_may_end.wait()
        yield json.dumps({"model": ONE_SLOW, "prompt": "hi", "max_tokens": 1}).encode()

    async with httpx.AsyncClient(base_url=limited.url, timeout=60) as http:
        # The frontend holds this request from its arrival, while its body is still coming.
        held = asyncio.create_task(http.post("/v1/completions", content=slow_body(),
                                             headers={"content-type": "application/json"}))
        client = client_of(limited)
        await wait_for(lambda: _holds_one(limited), "the held request to arrive")
        before = metric(http_text(f"{limited.url}/metrics"), "turbine_frontend_inflight_limit_rejections_total")
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=ONE_SLOW, prompt="hi", max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == str(RETRY_AFTER)
        assert info.value.body["code"] == "overloaded" and "--max-inflight-requests" in info.value.body["message"]
        after = metric(http_text(f"{limited.url}/metrics"), "turbine_frontend_inflight_limit_rejections_total")
        assert after - before == 1
        body_may_end.set()
        assert (await held).status_code == 200
        # The held request is gone: the next one is served.
        reply = await client.completions.create(model=ONE_SLOW, prompt="hi", max_tokens=1)
        assert reply.choices[0].finish_reason == "length"
        await client.close()


def _holds_one(frontend) -> bool:
    """Whether the frontend refuses new requests now (it holds its one request)."""
    try:
        return httpx.post(f"{frontend.url}/v1/completions", content=b"{}", timeout=5).status_code == 503
    except httpx.HTTPError:
        return False

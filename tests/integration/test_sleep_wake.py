"""Sleep / wake end to end: two simulated workers (real mocker processes) behind the real
frontend, driven with the official openai client. A sleeping worker leaves discovery first,
finishes what it was running, frees its KV cache, and gets no traffic until it wakes up and
registers again. (vLLM's CPU build cannot sleep: its refusal is tested in
tests/unit/vllm/test_sleep_refusal.py and against the shared vLLM worker below.)"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_json,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL
from turbine.protocol.generate import GenerateRequest, StopConditions
from turbine.protocol.generate import GenerateOutput
from turbine.protocol.sleep import IsSleepingRequest, SleepReply, SleepRequest, WakeUpRequest
from turbine.runtime.discovery.file import FileDiscovery
from turbine.runtime.discovery.registry import Registry
from turbine.runtime.errors import RemoteError
from turbine.runtime.request_plane import RequestPlaneClient

MODEL = DEFAULT_MODEL
PROMPT = "Tell me a long story about the sea and the ships that sail on it, and the people on them."


def post(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def registered(discovery_dir: str) -> dict[str, str]:
    """instance id -> request-plane address of every generate instance in discovery."""
    async def go():
        records = await Registry(FileDiscovery(discovery_dir)).list_instances()
        return {r.instance_id: r.address for r in records if r.endpoint == "generate"}
    return asyncio.run(go())


def worker_id(mocker) -> str:
    [line] = [ln for ln in http_text(f"{mocker.url}/metrics").splitlines()
              if ln.startswith("turbine_worker_total_kv_blocks{")]
    return line.split('worker_id="', 1)[1].split('"', 1)[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep-wake")
    discovery = str(root / "discovery")
    env = base_env(discovery)
    # Real-time steps (speedup 1): a 64-token answer takes a while, long enough to be in flight.
    a = start_mocker("mocker-a", env, root, "--speedup-ratio", "1")
    b = start_mocker("mocker-b", env, root, "--speedup-ratio", "1")
    frontend = start_frontend("frontend", env, root, "--router-mode", "round-robin")
    procs = [a, b, frontend]
    try:
        wait_until(lambda: worker_ready(a) and worker_ready(b), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees both workers", procs)
        yield {"a": a, "b": b, "frontend": frontend, "discovery": discovery, "procs": procs}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def client(pair) -> OpenAI:
    return OpenAI(base_url=f"{pair['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=60)


def requests_served(mocker) -> float:
    return metric(http_text(f"{mocker.url}/metrics"), "turbine_worker_requests_total")


def test_sleep_unregisters_drains_frees_kv_and_wake_registers_again(pair, client):
    a, b, frontend = pair["a"], pair["b"], pair["frontend"]
    a_id = worker_id(a)
    # Two streams at once, round-robin: one runs on each worker.
    results: list[tuple[str, int]] = []

    def stream():
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, stream=True,
                                                extra_body={"ignore_eos": True}))
        results.append((chunks[-1].choices[0].finish_reason, sum(bool(c.choices[0].text) for c in chunks)))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: metric(http_text(f"{a.url}/metrics"), "turbine_worker_inflight_requests") == 1, 30,
               "a request in flight on worker a", pair["procs"])
    assert metric(http_text(f"{a.url}/metrics"), "turbine_mocker_kv_blocks_in_use") > 0

    status, body = post(f"{a.url}/engine/sleep", {"level": 1})
    assert status == 200, body
    assert body["instances"][a_id]["is_sleeping"] and body["instances"][a_id]["level"] == 1
    # The sleep waited for the request it was running: it finished whole, not cut off.
    assert metric(http_text(f"{a.url}/metrics"), "turbine_worker_inflight_requests") == 0
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == ["length", "length"], results
    assert a_id not in registered(pair["discovery"])
    wait_until(lambda: instances_of(frontend, MODEL) == 1, 10, "frontend drops the sleeping worker", pair["procs"])

    # Its KV cache is freed: nothing cached (the prompt's blocks were), no capacity while asleep.
    a_metrics = http_text(f"{a.url}/metrics")
    assert metric(a_metrics, "turbine_mocker_kv_blocks_cached") == 0
    assert metric(a_metrics, "turbine_mocker_kv_blocks_in_use") == 0
    assert metric(a_metrics, "turbine_worker_total_kv_blocks") == 0
    assert http_json(f"{a.url}/engine/is_sleeping") == (200, {"is_sleeping": True, "instances": {a_id: 1}})
    assert http_json(f"{a.url}/health")[1]["status"] == "sleeping"

    # The frontend routes only to the awake worker.
    a_before, b_before = requests_served(a), requests_served(b)
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert requests_served(a) == a_before and requests_served(b) == b_before + 4

    status, body = post(f"{a.url}/engine/sleep", {"level": 2})
    assert status == 200 and body["instances"][a_id]["message"] == "already sleeping (level 1)", body

    status, body = post(f"{a.url}/engine/wake_up")
    assert status == 200 and not body["instances"][a_id]["is_sleeping"], body
    assert a_id in registered(pair["discovery"])
    wait_until(lambda: instances_of(frontend, MODEL) == 2, 10, "frontend routes to the woken worker", pair["procs"])
    assert metric(http_text(f"{a.url}/metrics"), "turbine_worker_total_kv_blocks") > 0
    wait_until(lambda: worker_ready(a), 10, "worker a healthy again", pair["procs"])
    a_before = requests_served(a)
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert requests_served(a) == a_before + 2


def test_sleep_fails_what_outlives_the_drain_and_refuses_new_requests(pair):
    """Over the request plane: a request still running when the drain timeout passes ends with a
    retryable shutting_down error (a frontend re-issues it elsewhere) and its KV blocks are freed;
    a request sent straight to the sleeping worker is refused the same way."""
    b = pair["b"]
    b_id = worker_id(b)
    address = registered(pair["discovery"])[b_id]
    long = GenerateRequest(request_id="long", model=MODEL, token_ids=list(range(100, 160)),
                           stop=StopConditions(max_tokens=2000, ignore_eos=True))

    async def go():
        rp = RequestPlaneClient()
        try:
            async def run_long():
                return [c async for c in rp.stream(address, "generate", long, GenerateOutput)]
            running = asyncio.create_task(run_long())
            while metric(http_text(f"{b.url}/metrics"), "turbine_mocker_kv_blocks_in_use") == 0:
                await asyncio.sleep(0.05)
            [reply] = [r async for r in rp.stream(address, "sleep", SleepRequest(level=1, drain_timeout=0.3),
                                                  SleepReply)]
            assert reply.status == "success" and reply.is_sleeping, reply
            with pytest.raises(RemoteError) as failed:
                await running
            assert failed.value.error.code == "shutting_down" and failed.value.error.retryable
            with pytest.raises(RemoteError) as refused:
                [c async for c in rp.stream(address, "generate", long, GenerateOutput)]
            assert refused.value.error.code == "shutting_down" and "asleep" in refused.value.error.message
            [state] = [r async for r in rp.stream(address, "is_sleeping", IsSleepingRequest(), SleepReply)]
            assert state.is_sleeping and state.level == 1
            [bad] = [r async for r in rp.stream(address, "sleep", SleepRequest(level=3), SleepReply)]
            assert bad.status == "error" and "level 3" in bad.message
            [woke] = [r async for r in rp.stream(address, "wake_up", WakeUpRequest(), SleepReply)]
            assert woke.status == "success" and not woke.is_sleeping
        finally:
            await rp.close()

    asyncio.run(go())
    assert metric(http_text(f"{b.url}/metrics"), "turbine_mocker_kv_blocks_in_use") == 0
    assert b_id in registered(pair["discovery"])
    wait_until(lambda: instances_of(pair["frontend"], MODEL) == 2, 10, "both workers routed to", pair["procs"])


def test_bad_sleep_requests_are_4xx_and_change_nothing(pair):
    a = pair["a"]
    assert post(f"{a.url}/engine/sleep", {"level": 5})[0] == 400
    status, body = post(f"{a.url}/engine/sleep", {"levl": 1})
    assert status == 400 and "levl" in body["message"]
    assert post(f"{a.url}/engine/sleep", {"instance_id": "nope"})[0] == 404
    assert post(f"{a.url}/engine/wake_up", {"level": 1})[0] == 400
    assert http_json(f"{a.url}/engine/is_sleeping")[1]["is_sleeping"] is False
    assert instances_of(pair["frontend"], MODEL) == 2


def test_a_model_whose_every_worker_sleeps_is_a_503_to_retry_not_a_404(pair, client):
    """The sleeping workers' cards stay, marked asleep: the frontend knows the model exists and answers
    503 model_asleep with Retry-After (chat, completions alike), then serves it again on wake-up."""
    a, b, frontend = pair["a"], pair["b"], pair["frontend"]
    for worker in (a, b):
        assert post(f"{worker.url}/engine/sleep", {"level": 1})[0] == 200
    wait_until(lambda: instances_of(frontend, MODEL) == 0, 10, "the frontend sees no awake worker", pair["procs"])
    for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [{"role": "user",
                                                                                              "content": "Hi"}]})):
        request = urllib.request.Request(f"{frontend.url}/v1/{path}", method="POST", data=json.dumps(
            {"model": MODEL, "max_tokens": 2, **body}).encode(), headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 503 and int(refused.value.headers["retry-after"]) > 0
        assert error["code"] == "model_asleep" and error["param"] == "model" and MODEL in error["message"]
    # Another model's name is still a 404.
    with pytest.raises(Exception) as unknown:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert getattr(unknown.value, "status_code", None) == 404
    for worker in (a, b):
        assert post(f"{worker.url}/engine/wake_up")[0] == 200
    wait_until(lambda: instances_of(frontend, MODEL) == 2, 10, "both workers routed to again", pair["procs"])
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None

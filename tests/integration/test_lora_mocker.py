"""LoRA adapters on simulated workers through the real frontend, with the official openai client:
loaded and unloaded at run time on a worker's status port (with the cluster key), listed in
/v1/models with their base as parent, routed only to the workers that hold them, given at start
with --lora-modules (a restart brings back only those), and in disaggregated serving prefilled
remotely only where a prefill worker holds the adapter (otherwise aggregated, counted)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.procs import (
    _start,
    base_env,
    http_json,
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
from tests.integration.test_router_service import router_address
from tests.lora_adapters import build_adapter, corrupt_copy
from turbine.protocol.router import BEST_WORKER, BestWorkerReply, BestWorkerRequest
from turbine.runtime.cluster_auth import ClusterAuth
from turbine.runtime.request_plane import RequestPlaneClient
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
KEY = "lora-test-cluster-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("lora-mocker-adapters")
    good = build_adapter(model_dir, root / "good")
    return {"good": good, "corrupt": corrupt_copy(good, root / "corrupt")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, adapter):
    root = tmp_path_factory.mktemp("lora-mocker")
    env = base_env(str(root / "discovery"))
    env["TURBINE_CLUSTER_KEY"] = KEY  # the status routes that change state need it
    common = ["--speedup-ratio", "0", "--block-size", "16", "--enable-lora", "--max-lora-rank", "8"]
    a = start_mocker("mocker-a", env, root, *common)
    b = start_mocker("mocker-b", env, root, *common, "--lora-modules", f"boot={adapter['good']}")
    frontend = start_frontend("frontend", env, root)
    router = _start("router", env, root, "turbine.router", "--system-port")
    procs = [a, b, frontend, router]
    try:
        wait_until(lambda: all(worker_ready(p) for p in (a, b)), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "the frontend sees both", procs)
        wait_until(lambda: "serving best_worker" in router.log_path.read_text(errors="replace"), 30,
                   "router registered", procs)
        yield {"a": a, "b": b, "frontend": frontend, "env": env, "root": root, "procs": procs}
    finally:
        stop_all(procs)


def models(frontend) -> dict[str, dict]:
    return {m["id"]: m for m in http_json(f"{frontend.url}/v1/models")[1]["data"]}


def successes(worker) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http_text(f"{worker.url}/metrics").splitlines()
               if line.startswith("turbine_worker_requests_total{") and 'outcome="success"' in line)


def client(frontend) -> OpenAI:
    return OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_load_list_route_unload(fleet, adapter):
    a, b, frontend = fleet["a"], fleet["b"], fleet["frontend"]
    body = {"lora_name": "sql", "source": {"uri": f"file://{adapter['good']}"}}
    # keyed worker: without the key nothing changes
    assert httpx.post(f"{a.url}/v1/loras", json=body).status_code == 401
    reply = httpx.post(f"{a.url}/v1/loras", json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "success" and reply.json()["lora_name"] == "sql" and reply.json()["lora_id"] >= 1
    assert [i["lora_name"] for i in httpx.get(f"{a.url}/v1/loras").json()["loras"]] == ["sql"]
    assert [i["lora_name"] for i in httpx.get(f"{b.url}/v1/loras").json()["loras"]] == ["boot"]

    wait_until(lambda: "sql" in models(frontend), 10, "the frontend lists the adapter", fleet["procs"])
    listed = models(frontend)
    assert listed["sql"]["parent"] == MODEL and listed["boot"]["parent"] == MODEL and listed[MODEL]["parent"] is None
    assert {m.id for m in client(frontend).models.list().data} == {MODEL, "sql", "boot"}

    # every adapter request lands on the worker that holds it; base requests on both
    before = (successes(a), successes(b))
    for i in range(6):
        out = client(frontend).completions.create(model="sql", prompt=f"adapter request {i}", max_tokens=4)
        assert out.model == "sql" and out.usage.completion_tokens == 4
    assert (successes(a) - before[0], successes(b) - before[1]) == (6, 0)
    for i in range(4):
        client(frontend).completions.create(model="boot", prompt=f"boot request {i}", max_tokens=4)
    assert (successes(a) - before[0], successes(b) - before[1]) == (6, 4)
    for i in range(6):
        client(frontend).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                                 max_tokens=4)
    assert successes(a) - before[0] > 6 and successes(b) - before[1] > 4  # the base model is served by both

    with pytest.raises(openai.NotFoundError) as info:
        client(frontend).completions.create(model="nope", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"

    assert httpx.delete(f"{a.url}/v1/loras/sql").status_code == 401
    reply = httpx.delete(f"{a.url}/v1/loras/sql", headers=AUTH)
    assert reply.status_code == 200 and reply.json()["status"] == "success"
    assert httpx.delete(f"{a.url}/v1/loras/sql", headers=AUTH).status_code == 404
    wait_until(lambda: "sql" not in models(frontend), 10, "the frontend drops the adapter", fleet["procs"])
    with pytest.raises(openai.NotFoundError):
        client(frontend).completions.create(model="sql", prompt="x", max_tokens=2)
    client(frontend).completions.create(model=MODEL, prompt="the base still serves", max_tokens=2)


def test_a_corrupt_adapter_is_refused_and_listed_nowhere(fleet, adapter):
    a, frontend = fleet["a"], fleet["frontend"]
    reply = httpx.post(f"{a.url}/v1/loras", headers=AUTH, timeout=30,
                       json={"lora_name": "broken", "source": {"uri": str(adapter["corrupt"])}})
    assert reply.status_code == 400 and "truncated or corrupt" in reply.json()["message"]
    assert "broken" not in [i["lora_name"] for i in httpx.get(f"{a.url}/v1/loras").json()["loras"]]
    assert "broken" not in models(frontend)
    bad = httpx.post(f"{a.url}/v1/loras", headers=AUTH, json={"lora_name": "x", "source": {"uri": "s3://b/k"}})
    assert bad.status_code == 400 and "not supported" in bad.json()["message"]
    assert httpx.post(f"{a.url}/v1/loras", headers=AUTH, json={"lora_name": "x"}).status_code == 400


def test_kv_routing_keeps_adapter_prefixes_apart(fleet):
    """The simulated workers' KV events name the adapter; the router service counts the base
    prompt's cached prefix only for the base model, the adapter's only for the adapter, and sends
    the adapter only to its holder."""
    b, frontend = fleet["b"], fleet["frontend"]
    b_id = next(iter(http_json(f"{b.url}/engine/is_sleeping")[1]["instances"]))
    ids = list(range(1000, 1000 + 12 * 16))  # 12 full blocks

    async def ask(model: str, lora_name: str | None) -> BestWorkerReply:
        rp = RequestPlaneClient(auth=ClusterAuth(KEY.encode()))
        try:
            address = await router_address(fleet["env"])
            request = BestWorkerRequest(model=model, token_ids=ids, lora_name=lora_name)
            return [r async for r in rp.stream(address, BEST_WORKER, request, BestWorkerReply)][0]
        finally:
            await rp.close()

    def best(model: str, lora_name: str | None = None) -> BestWorkerReply:
        reply = asyncio.run(ask(model, lora_name))
        assert not reply.error, reply.error
        return reply

    assert best(MODEL).overlap_blocks == 0
    client(frontend).completions.create(model=MODEL, prompt=ids, max_tokens=1)
    wait_until(lambda: best(MODEL).overlap_blocks == 12, 10, "the base prompt's blocks indexed", fleet["procs"])
    adapter = best("boot")
    assert adapter.overlap_blocks == 0 and adapter.instance_id == b_id
    client(frontend).completions.create(model="boot", prompt=ids, max_tokens=1)
    wait_until(lambda: best("boot").overlap_blocks == 12, 10, "the adapter prompt's blocks indexed", fleet["procs"])
    assert best("boot").instance_id == b_id
    # the base model's name with lora_name is the same question
    same = best(MODEL, lora_name="boot")
    assert (same.instance_id, same.overlap_blocks) == (b_id, 12)
    assert "holds the LoRA adapter 'nope'" in asyncio.run(ask(MODEL, "nope")).error


def test_a_restart_brings_back_only_the_start_adapters(fleet, adapter):
    b, frontend = fleet["b"], fleet["frontend"]
    reply = httpx.post(f"{b.url}/v1/loras", headers=AUTH, timeout=30,
                       json={"lora_name": "runtime", "source": {"uri": str(adapter["good"])}})
    assert reply.status_code == 200
    wait_until(lambda: "runtime" in models(frontend), 10, "the frontend lists it", fleet["procs"])
    b.stop()
    fleet["procs"].remove(b)
    wait_until(lambda: "boot" not in models(frontend) and "runtime" not in models(frontend), 10,
               "the stopped worker's adapters gone", fleet["procs"])
    again = start_mocker("mocker-b2", fleet["env"], fleet["root"], "--speedup-ratio", "0", "--block-size", "16",
                         "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"boot={adapter['good']}")
    fleet["procs"].append(again)
    wait_until(lambda: "boot" in models(frontend), 60, "the restarted worker's start adapter", fleet["procs"])
    assert "runtime" not in models(frontend)
    assert [i["lora_name"] for i in httpx.get(f"{again.url}/v1/loras").json()["loras"]] == ["boot"]


def test_disaggregated_adapters_prefill_remotely_only_where_a_prefill_worker_holds_them(tmp_path, adapter):
    env = base_env(str(tmp_path / "discovery"))
    common = ["--speedup-ratio", "0", "--block-size", "16", "--enable-lora"]
    prefill = start_mocker("prefill", env, tmp_path, "--is-prefill-worker", *common)
    decode = start_mocker("decode", env, tmp_path, "--is-decode-worker", *common,
                          "--lora-modules", f"sql={adapter['good']}")
    frontend = start_frontend("frontend", env, tmp_path, "--max-local-prefill-length", "8")
    procs = [prefill, decode, frontend]
    prompt = "a prompt long enough to be prefilled on a prefill worker " * 4

    def counts(model: str) -> tuple[float, float]:
        text = http_text(f"{frontend.url}/metrics")
        remote = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("turbine_frontend_prefills_total{") and f'model="{model}"' in line
                     and 'where="remote"' in line)
        return remote, metric(text, "turbine_frontend_disagg_lora_fallback_total")
    try:
        wait_until(lambda: all(worker_ready(p) for p in (prefill, decode)), 60, "mockers ready", procs)
        wait_until(lambda: prefill_workers_of(frontend, MODEL) == 1
                   and "sql" in models(frontend), 30, "the frontend sees both roles and the adapter", procs)
        out = client(frontend).completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert out.usage.completion_tokens == 4 and counts(MODEL) == (1, 0)
        # the prefill worker does not hold the adapter: aggregated on the decode worker, counted
        out = client(frontend).completions.create(model="sql", prompt=prompt, max_tokens=4)
        assert out.usage.completion_tokens == 4 and counts("sql") == (0, 1)
        reply = httpx.post(f"{prefill.url}/v1/loras", timeout=30,
                           json={"lora_name": "sql", "source": {"uri": str(adapter["good"])}})
        assert reply.status_code == 200, reply.text

        attempt = iter(range(1000))

        def remote_now() -> bool:  # a new prompt each time: one the decode worker has not cached
            client(frontend).completions.create(model="sql", prompt=f"{next(attempt)} {prompt}", max_tokens=4)
            return counts("sql")[0] >= 1
        wait_until(remote_now, 15, "adapter requests prefilled on the prefill worker", procs)
    finally:
        stop_all(procs)

"""LoRA adapters on real vLLM CPU workers (--enable-lora), loaded at run time through a worker's
status port, served through the real frontend to the official openai client. The adapter is a
real one made with peft for the embedded SmolLM2 (random weights that change its greedy output);
the reference is vLLM's own offline LLM(enable_lora=True) with a LoRARequest, same settings, run
first in a process of its own. One pair of workers for the whole module (run it under the
engine lock: flock /tmp/turbine-engine.lock); b has one adapter slot (--max-loras 1) and two
adapters given at start, so its load reports show the engine swapping them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    _start,
    base_env,
    http_json,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.integration.test_router_service import router_address
from tests.lora_adapters import build_adapter, corrupt_copy
from turbine.config import DiscoveryConfig, make_registry
from turbine.protocol.router import BEST_WORKER, BestWorkerReply, BestWorkerRequest
from turbine.router.cost import LoadTracker
from turbine.router.indexer import WorkerKey
from turbine.router.load_consumer import LoadMetricsConsumer
from turbine.runtime.request_plane import RequestPlaneClient

LORA_FLAGS = ["--dtype", "float32", "--enable-lora", "--max-lora-rank", "8"]
PROMPT = "The capital of France is"
MAX_TOKENS = 16
# A prompt of many KV blocks (whatever the engine's block size) for the prefix-routing test.
LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(40))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("lora-vllm-adapters")
    good = build_adapter(model_dir, root / "good")
    return {"good": good, "corrupt": corrupt_copy(good, root / "corrupt")}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from turbine.frontend.models.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def reference(adapters, model_dir, tokenizer, tmp_path_factory):
    """vLLM's offline greedy token ids, base and adapter, before the workers start (2 cores)."""
    ids = tokenizer.encode(PROMPT)
    env = base_env(str(tmp_path_factory.mktemp("lora-ref")))
    out = subprocess.run([sys.executable, "-m", "tests.integration.lora_reference", model_dir, str(adapters["good"]),
                          json.dumps(ids), str(MAX_TOKENS)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith('{"base"'))  # vLLM logs there too
    return {"ids": ids, **json.loads(line)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, reference, adapters):
    root = tmp_path_factory.mktemp("lora-vllm")
    env = base_env(str(root / "discovery"))
    # b loads its adapters at start (--lora-modules, as vLLM spells it); a gets its adapters at run time
    workers = [start_worker("lora-a", env, root, *LORA_FLAGS, "--max-loras", "2"),
               start_worker("lora-b", env, root, *LORA_FLAGS, "--max-loras", "1", "--lora-modules",
                            f"boot={adapters['good']}", f"boot2={adapters['good']}")]
    frontend = start_frontend("frontend", env, root)  # round-robin: base requests go to both
    kv_frontend = start_frontend("kv-frontend", env, root, "--router-mode", "kv")
    router = _start("router", env, root, "turbine.router", "--system-port")
    procs = [*workers, frontend, kv_frontend, router]
    try:
        wait_until(lambda: all(worker_ready(w) for w in workers), ENGINE_START_TIMEOUT, "workers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2 and instances_of(kv_frontend, MODEL) == 2, 30,
                   "the frontends see both workers", procs)
        yield {"a": workers[0], "b": workers[1], "frontend": frontend, "kv": kv_frontend, "env": env, "procs": procs,
               "discovery": str(root / "discovery")}
    finally:
        stop_all(procs)


def models(frontend) -> dict[str, dict]:
    return {m["id"]: m for m in http_json(f"{frontend.url}/v1/models")[1]["data"]}


def client(frontend) -> OpenAI:
    return OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=120)


def successes(worker) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http_text(f"{worker.url}/metrics").splitlines()
               if line.startswith("turbine_worker_requests_total{") and 'outcome="success"' in line)


def load(worker, name: str, uri: str) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/loras", json={"lora_name": name, "source": {"uri": uri}}, timeout=120)


def test_a_runtime_adapter_changes_greedy_output_as_vllm_offline_does(fleet, adapters, reference, tokenizer):
    a, frontend = fleet["a"], fleet["frontend"]
    reply = load(a, "sql", str(adapters["good"]))
    assert reply.status_code == 200 and reply.json()["status"] == "success", reply.text
    assert [i["lora_name"] for i in httpx.get(f"{a.url}/v1/loras").json()["loras"]] == ["sql"]
    wait_until(lambda: "sql" in models(frontend) and "sql" in models(fleet["kv"]), 15, "the frontends list it",
               fleet["procs"])
    assert models(frontend)["sql"]["parent"] == MODEL and models(frontend)["boot"]["parent"] == MODEL
    assert [i["lora_name"] for i in httpx.get(f"{fleet['b'].url}/v1/loras").json()["loras"]] == ["boot", "boot2"]
    ours = {model: client(frontend).completions.create(model=model, prompt=reference["ids"], max_tokens=MAX_TOKENS,
                                                       temperature=0).choices[0].text
            for model in (MODEL, "sql")}
    assert ours["sql"] != ours[MODEL]  # the adapter changes the greedy output
    assert ours["sql"] == tokenizer.decode(reference["adapter"], skip_special_tokens=True)
    assert ours[MODEL] == tokenizer.decode(reference["base"], skip_special_tokens=True)
    boot = client(frontend).completions.create(model="boot", prompt=reference["ids"], max_tokens=MAX_TOKENS,
                                               temperature=0).choices[0].text
    assert boot == ours["sql"]  # the same adapter, loaded at start on the other worker


def instance_of(worker) -> str:
    return next(iter(http_json(f"{worker.url}/engine/is_sleeping")[1]["instances"]))


async def reports_after_requests(discovery_dir: str, instance: str, frontend, adapters: list[str],
                                 timeout: float = 20.0) -> list:
    """Follows `instance`'s load reports as a router does (subscribed first: reports go out on
    change), then asks for one completion of each adapter in turn and returns the first report
    naming it as the engine's active adapter (or the last one seen, for the assertion)."""
    registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
    await registry.backend.start()
    try:
        card = next(c for c in await registry.list_models() if c.instance_id == instance and c.lora_name is None)
    finally:
        await registry.backend.close()
    tracker = LoadTracker()
    consumer = LoadMetricsConsumer(tracker)
    consumer.sync({instance: card})
    reports = []
    try:
        await consumer._sub.subscribed(card.load_metrics_address or card.kv_events_address)
        for adapter in adapters:
            reply = await asyncio.to_thread(client(frontend).completions.create, model=adapter, prompt=PROMPT,
                                            max_tokens=4)
            assert reply.usage.completion_tokens >= 1
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                report = tracker.reported(WorkerKey(instance))
                if report is not None and report.active_loras == [adapter]:
                    break
                await asyncio.sleep(0.1)
            reports.append(tracker.reported(WorkerKey(instance)))
        return reports
    finally:
        consumer.close()


def test_the_load_report_names_the_adapter_in_the_engines_slot(fleet):
    """b has one slot: after boot's request its report says boot, after boot2's boot2 (boot swapped out)."""
    reports = asyncio.run(reports_after_requests(fleet["discovery"], instance_of(fleet["b"]), fleet["frontend"],
                                                 ["boot", "boot2"]))
    for adapter, report in zip(["boot", "boot2"], reports, strict=True):
        assert report is not None and report.max_loras == 1 and report.active_loras == [adapter], report


def test_ten_concurrent_loads_of_one_name_are_one_engine_load(fleet, adapters):
    a = fleet["a"]
    loads = lambda: metric(http_text(f"{a.url}/metrics"), "turbine_worker_lora_engine_loads_total")  # noqa: E731
    before = loads()
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda _: load(a, "twice", f"file://{adapters['good']}"), range(10)))
    assert [r.status_code for r in replies] == [200] * 10
    assert len({r.json()["lora_id"] for r in replies}) == 1
    assert loads() - before == 1
    assert httpx.delete(f"{a.url}/v1/loras/twice").status_code == 200


def test_a_corrupt_adapter_is_refused_and_listed_nowhere(fleet, adapters):
    a, frontend = fleet["a"], fleet["frontend"]
    reply = load(a, "broken", str(adapters["corrupt"]))
    assert reply.status_code == 400 and "truncated or corrupt" in reply.json()["message"]
    assert "broken" not in [i["lora_name"] for i in httpx.get(f"{a.url}/v1/loras").json()["loras"]]
    assert "broken" not in models(frontend)
    # a worker without --enable-lora would refuse with 501; this one refuses names it cannot serve
    assert load(a, MODEL, str(adapters["good"])).status_code == 400


def test_adapter_requests_land_only_on_the_worker_that_holds_it(fleet):
    a, b, frontend = fleet["a"], fleet["b"], fleet["frontend"]
    before = (successes(a), successes(b))
    for i in range(5):
        client(frontend).completions.create(model="sql", prompt=f"Request {i}:", max_tokens=2)
    assert (successes(a) - before[0], successes(b) - before[1]) == (5, 0)
    for i in range(6):
        client(frontend).completions.create(model=MODEL, prompt=f"Base request {i}:", max_tokens=2)
    assert successes(a) - before[0] > 5 and successes(b) - before[1] > 0


def test_kv_routing_keeps_adapter_prefixes_apart(fleet, tokenizer):
    """The engine's KV events carry the adapter (relayed as lora_name): the router counts the base
    model's cached prefix only for base requests, the adapter's only for the adapter's, and
    routes the adapter only to the worker that holds it."""
    a, kv = fleet["a"], fleet["kv"]
    a_id = instance_of(a)
    ids = tokenizer.encode(LONG)

    async def ask(model: str) -> BestWorkerReply:
        rp = RequestPlaneClient()
        try:
            address = await router_address(fleet["env"])
            return [r async for r in rp.stream(address, BEST_WORKER, BestWorkerRequest(model=model, token_ids=ids),
                                               BestWorkerReply)][0]
        finally:
            await rp.close()

    def best(model: str) -> BestWorkerReply:
        reply = asyncio.run(ask(model))
        assert not reply.error, reply.error
        return reply

    first = best(MODEL)
    assert first.prompt_blocks >= 2 and first.overlap_blocks == 0
    client(kv).completions.create(model=MODEL, prompt=ids, max_tokens=1)
    wait_until(lambda: best(MODEL).overlap_blocks >= first.prompt_blocks - 1, 15,
               "the base prompt's blocks indexed", fleet["procs"])
    base_holder = best(MODEL).instance_id
    adapter = best("sql")
    assert adapter.overlap_blocks == 0 and adapter.instance_id == a_id  # the base's cache is not the adapter's
    client(kv).completions.create(model="sql", prompt=ids, max_tokens=1)
    wait_until(lambda: best("sql").overlap_blocks >= first.prompt_blocks - 1, 15,
               "the adapter prompt's blocks indexed", fleet["procs"])
    assert best("sql").instance_id == a_id
    assert best(MODEL).instance_id == base_holder  # the base prefix is still where it was


def test_unloaded_adapters_are_404_and_the_base_keeps_serving(fleet):
    a, frontend = fleet["a"], fleet["frontend"]
    reply = httpx.delete(f"{a.url}/v1/loras/sql")
    assert reply.status_code == 200 and reply.json()["status"] == "success"
    wait_until(lambda: "sql" not in models(frontend), 15, "the frontend drops the adapter", fleet["procs"])
    with pytest.raises(openai.NotFoundError) as info:
        client(frontend).completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert client(frontend).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2

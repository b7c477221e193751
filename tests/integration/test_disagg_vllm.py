"""Disaggregated prefill/decode on real vLLM CPU engines with real NIXL: one prefill worker,
one decode worker (float32, so that greedy text must match exactly), and two frontends on
the same engines: one sends every prompt through the prefill worker, the other prefills on
the decode worker (aggregated serving). Its own discovery directory keeps the session
cluster's frontend from seeing these workers."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import jsonschema
import openai
import psutil
import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    base_env,
    http_json,
    http_text,
    instances_of,
    metric,
    mp_layout,
    prefill_workers_of,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.config import DiscoveryConfig, make_registry
from turbine.protocol.generate import (
    ClearKvBlocksRequest,
    GenerateOutput,
    GenerateRequest,
    SamplingOptions,
    StatusReply,
    StopConditions,
)
from turbine.router.config import KvRouterConfig
from turbine.router.indexer import WorkerKey
from turbine.router.model_router import ModelKvRouter
from turbine.runtime.errors import RemoteError
from turbine.runtime.request_plane import RequestPlaneClient
from turbine.serve import split_cpu_cores

FLOAT32 = ["--dtype", "float32"]
PROMPTS = [
    "The history of the Roman Empire spans many centuries. " * 8 + "In this essay we will",
    "Photosynthesis turns light into chemical energy in plants. " * 9 + "The key steps are",
    "A good recipe for bread needs flour, water, salt and yeast. " * 7 + "First, you",
    "The rules of chess: each player starts with sixteen pieces. " * 8 + "The knight moves",
]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("disagg")
    env = mp_layout(base_env(str(root / "discovery")))  # the connectors' worker halves in vLLM CPU's own layout
    # Each engine computes on its own half of the cores, as `turbine serve --disagg` arranges.
    prefill_env, decode_env = (dict(env, **cpus) for cpus in split_cpu_cores(env))
    prefill = start_worker("prefill", prefill_env, root, "--is-prefill-worker", "--connector", "nixl", *FLOAT32)
    decode = start_worker("decode", decode_env, root, "--disaggregation-mode", "decode", "--connector", "nixl",
                          *FLOAT32)
    # Every prompt goes through the prefill worker / no prompt does (aggregated on the decode worker).
    disagg = start_frontend("frontend-disagg", env, root, "--max-local-prefill-length", "0")
    local = start_frontend("frontend-local", env, root, "--max-local-prefill-length", "1000000")
    procs = [prefill, decode, disagg, local]
    try:
        wait_until(lambda: worker_ready(prefill) and worker_ready(decode), ENGINE_START_TIMEOUT,
                   "prefill and decode workers ready", procs)
        # Both frontends: each follows discovery on its own (the local one was once asked too early: 404).
        wait_until(lambda: all(instances_of(f, MODEL) == 1 and prefill_workers_of(f, MODEL) == 1
                               for f in (disagg, local)), 30,
                   "both frontends see the decode and the prefill worker", procs)
        yield {"prefill": prefill, "decode": decode, "disagg": disagg, "local": local, "env": env, "root": root,
               "cores": {"prefill": prefill_env.get("VLLM_CPU_OMP_THREADS_BIND"),
                         "decode": decode_env.get("VLLM_CPU_OMP_THREADS_BIND")}}
    finally:
        stop_all(procs)


def client(frontend) -> OpenAI:
    return OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=180)


def worker_metric(worker, name: str, **labels) -> float:
    text = http_text(f"{worker.url}/metrics")
    if labels:
        want = [f'{k}="{v}"' for k, v in labels.items()]
        text = "\n".join(line for line in text.splitlines() if all(w in line for w in want))
    return metric(text, name)


def request_plane_address(worker) -> str:
    """The worker's request-plane address, from its log line 'serving ... at HOST:PORT'."""
    for line in worker.log_path.read_text(errors="replace").splitlines():
        if "turbine.vllm: worker " in line and " serving " in line:
            return line.rsplit(" at ", 1)[1].strip()
    raise AssertionError(f"no serving line in {worker.name}'s log")


def clear_cache(worker) -> None:
    async def go():
        rp = RequestPlaneClient()
        try:
            return [r async for r in rp.stream(request_plane_address(worker), "clear_kv_blocks",
                                               ClearKvBlocksRequest(), StatusReply)]
        finally:
            await rp.close()
    replies = asyncio.run(go())
    assert replies and replies[0].status == "success", replies


def no_blocks_held(*workers) -> bool:
    return all(worker_metric(w, "turbine_worker_active_kv_blocks") == 0 for w in workers)


def test_greedy_output_is_identical_aggregated_and_disaggregated(pd):
    kv_source = "vllm:prompt_tokens_by_source_total"
    local_text = [client(pd["local"]).completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                  for p in PROMPTS]
    clear_cache(pd["decode"])  # the disaggregated run must not find the prompts cached on the decode side
    pulled_before = worker_metric(pd["decode"], kv_source, source="external_kv_transfer")
    computed_before = worker_metric(pd["decode"], kv_source, source="local_compute")

    disagg_text = [client(pd["disagg"]).completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                   for p in PROMPTS]

    assert [r.choices[0].text for r in disagg_text] == [r.choices[0].text for r in local_text]
    assert all(r.usage.completion_tokens == 24 for r in disagg_text)
    # The KV really moved: the decode engine took every prompt token from the prefill worker
    # (vLLM counts the recomputed last token as transferred too) and computed at most that one.
    prompt_tokens = sum(r.usage.prompt_tokens for r in disagg_text)
    pulled = worker_metric(pd["decode"], kv_source, source="external_kv_transfer") - pulled_before
    computed = worker_metric(pd["decode"], kv_source, source="local_compute") - computed_before
    assert pulled == prompt_tokens, (pulled, prompt_tokens)
    assert computed <= len(PROMPTS), computed
    assert metric(http_text(f"{pd['disagg'].url}/metrics"), "turbine_frontend_prefills_total") >= len(PROMPTS)


def model_thread_cores(worker) -> set[int]:
    """The cores of the thread that runs the model: the main thread of vLLM's worker process."""
    runners = [p for p in psutil.Process(worker.popen.pid).children(recursive=True)
               if p.name().startswith("VLLM::Worker")]
    assert len(runners) == 1, runners
    return set(psutil.Process(runners[0].pid).cpu_affinity())


def test_each_engine_computes_on_its_own_cores(pd):
    """vLLM's NIXL worker moves the model thread of every engine onto the host's last core;
    Turbine puts back the binding the engine was given (see turbine/vllm/nixl_cpu.py).
    Without that, prefill and decode share one core and a loaded pair crawls."""
    if not all(pd["cores"].values()):
        pytest.skip("fewer than 2 cores: the engines are not bound apart")
    for role in ("prefill", "decode"):
        want = {int(c) for c in pd["cores"][role].split(",")}
        assert model_thread_cores(pd[role]) == want, role


def test_n_greater_than_one_is_served_with_every_choice(pd):
    before = metric(http_text(f"{pd['disagg'].url}/metrics"), "turbine_frontend_prefills_total")
    r = client(pd["disagg"]).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3,
                                                temperature=0.9, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in r.choices)
    assert r.usage.completion_tokens == 24
    # n > 1 is prefilled on the decode worker (one hand-off carries one sequence's KV).
    assert metric(http_text(f"{pd['disagg'].url}/metrics"), "turbine_frontend_prefills_total") == before


@pytest.mark.parametrize("cancel_after_s", [0.2, 1.0, 2.5])
def test_client_cancel_during_prefill_or_transfer_leaves_no_blocks_pinned(pd, cancel_after_s):
    """Cancelled at several points of the hand-off (prefill running, KV moving, decode
    starting), neither engine may keep blocks: both return to zero well before NIXL's own
    30 s lease on unclaimed prefill blocks would free them."""
    wait_until(lambda: no_blocks_held(pd["prefill"], pd["decode"]), 30, "idle engines at the start")
    long_prompt = " ".join(PROMPTS) * 3
    stream = client(pd["disagg"]).completions.create(model=MODEL, prompt=long_prompt, max_tokens=200,
                                                     temperature=0, stream=True)
    time.sleep(cancel_after_s)
    stream.close()
    wait_until(lambda: no_blocks_held(pd["prefill"], pd["decode"]), 20, "both engines free their KV blocks",
               [pd["prefill"], pd["decode"], pd["disagg"]])
    # And the pair still serves.
    r = client(pd["disagg"]).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_decode_without_reachable_kv_prefills_locally(pd):
    """KV parameters that point at a peer that never answers: the decode worker gives up on
    the transfer (vLLM's handshake times out; our --kv-transfer-timeout is the backstop, see
    tests/unit/vllm/test_vllm_disagg_handlers.py) and computes the prompt itself: same answer."""
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen()  # accepts connections, never says a word
    prompt_ids = list(range(1000, 1200))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "gone-engine", "remote_request_id": "gone-request",
              "remote_host": "127.0.0.1", "remote_port": black_hole.getsockname()[1], "tp_size": 1}

    async def generate(kv_transfer_params):
        rp = RequestPlaneClient()
        try:
            req = GenerateRequest(request_id=f"bh-{time.monotonic_ns()}", model=MODEL, token_ids=prompt_ids,
                                  sampling=SamplingOptions(temperature=0), stop=StopConditions(max_tokens=6),
                                  kv_transfer_params=kv_transfer_params)
            tokens = []
            async for out in rp.stream(request_plane_address(pd["decode"]), "generate", req, GenerateOutput):
                tokens += out.token_ids
            return tokens
        finally:
            await rp.close()

    try:
        started = time.monotonic()
        pulled = asyncio.run(generate(params))
        took = time.monotonic() - started
    finally:
        black_hole.close()
    assert pulled == asyncio.run(generate(None))
    assert took < 60, took
    wait_until(lambda: no_blocks_held(pd["decode"]), 20, "decode engine frees its blocks")


def test_bad_kv_transfer_params_are_refused_not_fatal(pd):
    async def generate(params):
        rp = RequestPlaneClient()
        try:
            req = GenerateRequest(request_id="bad-params", model=MODEL, token_ids=[1, 2, 3],
                                  stop=StopConditions(max_tokens=2), kv_transfer_params=params)
            return [o async for o in rp.stream(request_plane_address(pd["decode"]), "generate", req, GenerateOutput)]
        finally:
            await rp.close()

    for bad in ({"do_remote_prefill": True, "remote_port": "x"}, {"do_remote_prefill": False},
                {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
                 "remote_host": "h", "remote_port": 1, "remote_block_ids": [[-1]]}):
        with pytest.raises(RemoteError) as info:
            asyncio.run(generate(bad))
        assert info.value.code == "invalid_request" and info.value.message.startswith("kv_transfer_params")
    assert pd["decode"].alive()


def test_the_decode_workers_load_reaches_a_router(pd):
    # Decode workers relay no KV events; their load reports still go out, to the address in the card.
    async def reported():
        registry = make_registry(DiscoveryConfig(backend="file", file_dir=str(pd["root"] / "discovery")))
        await registry.backend.start()
        try:
            [card] = [c for c in await registry.list_models() if c.disaggregation_mode == "decode"]
        finally:
            await registry.backend.close()
        assert card.load_metrics_address and card.data_parallel_size == 1
        router = ModelKvRouter(card.name, KvRouterConfig(), card.kv_block_size)
        try:
            router.instances_changed({card.instance_id: card})
            async with asyncio.timeout(15):  # re-sent every 5 s even when idle
                while router.kv.loads.reported(WorkerKey(card.instance_id)) is None:
                    await asyncio.sleep(0.1)
            return router.kv.loads.reported(WorkerKey(card.instance_id))
        finally:
            router.close()

    report = asyncio.run(reported())
    assert report.kv_total_blocks > 0


def test_structured_outputs_go_through_the_prefill_worker_too(pd):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}

    def remote_prefills() -> float:
        text = http_text(f"{pd['disagg'].url}/metrics")
        return metric("\n".join(line for line in text.splitlines() if '"remote"' in line),
                      "turbine_frontend_prefills_total")

    prefills_before = remote_prefills()
    r = client(pd["disagg"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert remote_prefills() == prefills_before + 1  # prefilled on the prefill worker, with the constraint
    # The prefill worker gets the constraint too: one its backend cannot compile is refused there.
    with pytest.raises(openai.BadRequestError) as info:
        client(pd["disagg"]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=5,
            extra_body={"guided_json": {"type": "array", "uniqueItems": True}})
    assert info.value.body["param"] == "guided_json"


def test_the_canaries_go_the_roles_way_and_the_prefill_keeps_no_blocks(pd):
    """Issue 33, §3: each worker's /health runs its canary through its role's handler (the prefill worker's
    as a prefill); the prefill worker's KV is freed when the canary ends, not pinned for a decode worker
    that never comes (NIXL's lease would free it only after 30 s, and log it as expired)."""
    wait_until(lambda: no_blocks_held(pd["prefill"], pd["decode"]), 30, "idle engines at the start")
    time.sleep(11)  # no request for longer than RECENT_SUCCESS_S: /health runs the canary
    for role in ("prefill", "decode"):
        status, body = http_json(f"{pd[role].url}/health", timeout=30)
        assert (status, body) == (200, {"status": "healthy"}), (role, body)
    wait_until(lambda: no_blocks_held(pd["prefill"]), 10, "the prefill canary's blocks freed", [pd["prefill"]])
    log = pd["prefill"].log_path.read_text(errors="replace")
    assert "health check passed" in log
    assert "Releasing expired KV blocks for request canary-" not in log


def test_prefill_worker_death_mid_prefill_falls_back_to_local_prefill(pd):
    """Last in this module: the prefill worker does not come back."""
    long_prompt = " ".join(PROMPTS) * 4
    expected = client(pd["local"]).completions.create(model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0)
    clear_cache(pd["decode"])
    result = {}

    def ask():
        result["r"] = client(pd["disagg"]).completions.create(model=MODEL, prompt=long_prompt, max_tokens=8,
                                                              temperature=0)

    t = threading.Thread(target=ask)
    t.start()
    wait_until(lambda: worker_metric(pd["prefill"], "turbine_worker_inflight_requests") >= 1, 60,
               "the prefill worker is computing the prompt", [pd["prefill"]])
    pd["prefill"].stop(signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the request hung after the prefill worker died"
    assert result["r"].choices[0].text == expected.choices[0].text
    fallback = [line for line in http_text(f"{pd['disagg'].url}/metrics").splitlines()
                if line.startswith("turbine_frontend_prefills_total") and "local_fallback" in line]
    assert fallback and float(fallback[0].rsplit(" ", 1)[1]) >= 1
    # Discovery forgets the dead worker (its lease expires): the frontend serves aggregated.
    wait_until(lambda: prefill_workers_of(pd["disagg"], MODEL) == 0, 30, "the frontend drops the dead prefill worker")
    r = client(pd["disagg"]).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"

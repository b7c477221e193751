"""Adapter-aware routing end to end: two simulated workers that both hold adapters x and y, one
active LoRA slot each, behind the real frontend (KV routing) and real file discovery, driven with the
official openai client. Requests for x stay on the worker whose slot holds x, concurrent or one after
another, so x is swapped in once; with the adapter term off (--router-lora-swap-weight 0) the same
requests spread by load over both workers, each of which swaps x in."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_json,
    http_text,
    instances_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.lora_adapters import build_adapter
from turbine.model.prepare import DEFAULT_MODEL


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, model_dir):
    return build_adapter(model_dir, tmp_path_factory.mktemp("lora-routing") / "adapter")


@pytest.fixture(scope="module", params=[None, "0"], ids=["aware", "term-off"])
def fleet(request, tmp_path_factory, adapter):
    root = tmp_path_factory.mktemp("lora-routing-fleet")
    env = base_env(str(root / "discovery"))
    # Ten times real time (a step about 3 ms, a swap 50 ms): the concurrent requests overlap.
    mocker = start_mocker("mocker", env, root, "--num-workers", "2", "--speedup-ratio", "10", "--enable-lora",
                          "--max-loras", "1", "--max-lora-rank", "8", "--lora-load-time-ms", "500",
                          "--lora-modules", f"x={adapter}", f"y={adapter}")
    weight = [] if request.param is None else ["--router-lora-swap-weight", request.param]
    frontend = start_frontend("frontend", env, root, "--router-mode", "kv", *weight)
    procs = [mocker, frontend]
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(frontend, DEFAULT_MODEL) == 2, 30, "the frontend sees both workers", procs)
        wait_until(lambda: {"x", "y"} <= {m["id"] for m in http_json(f"{frontend.url}/v1/models")[1]["data"]}, 30,
                   "the frontend lists both adapters", procs)
        yield {"mocker": mocker, "frontend": frontend, "aware": request.param is None}
    finally:
        stop_all(procs)


def per_worker(metrics: str, name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and 'outcome="failure"' not in line:
            worker = re.search(r'worker_id="([^"]+)"', line).group(1)
            values[worker] = values.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_requests_for_one_adapter_stay_on_the_worker_that_has_it_active(fleet):
    mocker, frontend = fleet["mocker"], fleet["frontend"]
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)

    def ask(i: int) -> None:
        # Prompts that share no prefix (token ids), so prefix overlap plays no part.
        reply = client.completions.create(model="x", prompt=[1000 + i] * 40, max_tokens=8,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8

    with ThreadPoolExecutor(6) as pool:  # six at once: by load alone they would spread over both
        list(pool.map(ask, range(6)))
    for i in range(6, 10):  # then one after another: the worker's load report names x active
        ask(i)
    metrics = http_text(f"{mocker.url}/metrics")
    served = sorted(per_worker(metrics, "turbine_worker_requests_total").values(), reverse=True)
    swaps = sum(per_worker(metrics, "turbine_mocker_lora_swaps_total").values())
    if fleet["aware"]:
        assert served[0] == 10 and sum(served) == 10 and swaps == 1, (served, swaps)
    else:  # the term removed: load balancing spreads them, and both workers swap x in
        assert len(served) == 2 and served[1] >= 2 and swaps >= 2, (served, swaps)

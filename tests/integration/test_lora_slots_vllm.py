"""A real vLLM CPU worker's load report names the LoRA adapters in its engine's active slots: one
slot (--max-loras 1), two adapters given at start, a request of each through the real frontend with
the official openai client; the report, read from the worker's event plane as a router reads it,
says x after x's request and y (x swapped out) after y's. Run it under the engine lock:
flock /tmp/turbine-engine.lock."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    base_env,
    http_json,
    instances_of,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
)
from tests.lora_adapters import build_adapter
from turbine.config import DiscoveryConfig, make_registry
from turbine.router.cost import LoadTracker
from turbine.router.indexer import WorkerKey
from turbine.router.load_consumer import LoadMetricsConsumer


@pytest.fixture(scope="module")
def worker(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("lora-slots-vllm")
    adapter = build_adapter(model_dir, root / "adapter")
    env = base_env(str(root / "discovery"))
    w = start_worker("lora-slots", env, root, "--dtype", "float32", "--enable-lora", "--max-loras", "1",
                     "--max-lora-rank", "8", "--lora-modules", f"x={adapter}", f"y={adapter}")
    frontend = start_frontend("frontend", env, root)
    procs = [w, frontend]
    try:
        wait_until(lambda: http_json(f"{w.url}/health", timeout=15)[0] == 200, ENGINE_START_TIMEOUT, "worker ready",
                   procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1 and {"x", "y"} <= {
            m["id"] for m in http_json(f"{frontend.url}/v1/models")[1]["data"]}, 30, "the frontend sees it", procs)
        yield {"frontend": frontend, "discovery": str(root / "discovery")}
    finally:
        stop_all(procs)


async def report_until(discovery_dir: str, want: list[str], timeout: float = 20.0):
    """The worker's load reports, as a router follows them, until one names `want` as its active adapters."""
    registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
    await registry.backend.start()
    try:
        cards = {c.instance_id: c for c in await registry.list_models() if c.lora_name is None}
    finally:
        await registry.backend.close()
    tracker = LoadTracker()
    consumer = LoadMetricsConsumer(tracker)
    consumer.sync(cards)
    [instance] = cards
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:  # the report is re-sent every 5 s: a late subscriber learns it
            report = tracker.reported(WorkerKey(instance))
            if report is not None and report.active_loras == want:
                return report
            await asyncio.sleep(0.1)
        return tracker.reported(WorkerKey(instance))
    finally:
        consumer.close()


def test_the_load_report_names_the_adapter_in_the_engines_slot(worker):
    client = OpenAI(base_url=f"{worker['frontend'].url}/v1", api_key="x", max_retries=0, timeout=120)
    for adapter, want in (("x", ["x"]), ("y", ["y"])):
        reply = client.completions.create(model=adapter, prompt="The capital of France is", max_tokens=8)
        assert reply.usage.completion_tokens >= 1
        report = asyncio.run(report_until(worker["discovery"], want))
        assert report is not None and report.max_loras == 1 and report.active_loras == want, report

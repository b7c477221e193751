"""The mocker's simulated KV tiers behind the real frontend: once every engine dropped its cache
(clear_kv_blocks), the KV router, following the tier events over the event plane, sends each
returning prompt back to the worker whose host tier holds it, where its blocks load as cached tokens."""

from __future__ import annotations

import asyncio

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL
from turbine.protocol.generate import ClearKvBlocksRequest, StatusReply
from turbine.runtime.request_plane import RequestPlaneClient

MODEL = DEFAULT_MODEL
WORKERS = 2
BS = 16
PROMPTS = 8  # without tier events each finds its holder by chance (a random tie-break: 1 in 2); all 8: 1 in 256


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-tiers-mocker")
    env = base_env(str(root / "discovery"))
    mockers = start_mocker("tier-mockers", env, root, "--num-workers", str(WORKERS), "--speedup-ratio", "0",
                           "--block-size", str(BS), "--num-gpu-blocks", "64", "--max-model-len", "1024",
                           "--kv-host-cache-gb", "0.05")
    frontend = start_frontend("tier-frontend", env, root, "--router-mode", "kv")
    procs = [mockers, frontend]
    try:
        wait_until(lambda: worker_ready(mockers), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == WORKERS, 30, "the frontend sees the fleet", procs)
        yield {"mockers": mockers, "frontend": frontend, "env": env}
    finally:
        stop_all(procs)


async def clear_every_engine(discovery_dir: str) -> list[str]:
    from turbine.config import DiscoveryConfig, make_registry

    registry = make_registry(DiscoveryConfig(file_dir=discovery_dir))
    await registry.backend.start()
    rp = RequestPlaneClient()
    try:
        addresses = {r.instance_id: r.address for r in await registry.list_instances()}
        return [r.status for address in addresses.values()
                async for r in rp.stream(address, "clear_kv_blocks", ClearKvBlocksRequest(), StatusReply)]
    finally:
        await rp.close()
        await registry.backend.close()


def test_a_returning_prompt_goes_back_to_the_worker_whose_tier_holds_it(fleet):
    frontend = fleet["frontend"]
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=60)
    prompts = [list(range(1000 + 1000 * i, 1000 + 1000 * i + 8 * BS)) + [5] for i in range(PROMPTS)]

    def cached(prompt) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(p) for p in prompts] == [0] * PROMPTS
    assert asyncio.run(clear_every_engine(fleet["env"]["TURBINE_DISCOVERY_DIR"])) == ["success"] * WORKERS
    # The router's index forgets the engines' blocks (AllBlocksCleared) and keeps the tiers'.
    wait_until(lambda: metric(http_text(f"{frontend.url}/metrics"), "turbine_router_indexed_blocks") == 0, 20,
               "the index forgot the engines' blocks", [frontend])
    assert [cached(p) for p in prompts] == [8 * BS] * PROMPTS  # every full block loaded from its holder's tier
    text = http_text(f"{fleet['mockers'].url}/metrics")
    assert metric(text, "turbine_mocker_kvbm_hits_total") == 8 * PROMPTS

"""Every worker kind publishes load reports, whatever its role or prefix caching, and they reach
a router: real mocker processes, the real event plane (zmq), the router's own consumers."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.procs import base_env, start_mocker, stop_all, wait_until, worker_ready
from turbine.config import DiscoveryConfig, make_registry
from turbine.router.config import KvRouterConfig
from turbine.router.indexer import WorkerKey
from turbine.router.model_router import ModelKvRouter

FLEET = {  # served model name -> mocker flags
    "decode-no-cache": ["--disaggregation-mode", "decode", "--no-enable-prefix-caching"],
    "agg-no-cache": ["--no-enable-prefix-caching"],
    "agg-dp2": ["--data-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-reports")
    env = base_env(str(root / "discovery"))
    procs = [start_mocker(name, env, root, "--served-model-name", name, "--speedup-ratio", "0",
                          "--block-size", "16", *flags) for name, flags in FLEET.items()]
    try:
        for p in procs:
            wait_until(lambda p=p: worker_ready(p), 60, f"{p.name} ready", procs)
        yield str(root / "discovery")
    finally:
        stop_all(procs)


async def card_of(discovery_dir: str, model: str):
    registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
    await registry.backend.start()
    try:
        [card] = [c for c in await registry.list_models() if c.name == model]
        return card
    finally:
        await registry.backend.close()


async def reported_by_router(card, ranks=(0,)):
    router = ModelKvRouter(card.name, KvRouterConfig(), card.kv_block_size)
    try:
        router.instances_changed({card.instance_id: card})
        async with asyncio.timeout(15):  # reports are re-sent every 5 s even when idle
            while any(router.kv.loads.reported(WorkerKey(card.instance_id, r)) is None for r in ranks):
                await asyncio.sleep(0.1)
        return [router.kv.loads.reported(WorkerKey(card.instance_id, r)) for r in ranks]
    finally:
        router.close()


async def test_a_decode_workers_load_reaches_the_router(fleet):
    card = await card_of(fleet, "decode-no-cache")
    assert card.disaggregation_mode == "decode" and card.load_metrics_address
    [report] = await reported_by_router(card)
    assert report.kv_total_blocks == 16384 and report.num_running == 0


async def test_each_data_parallel_ranks_load_reaches_the_router(fleet):
    card = await card_of(fleet, "agg-dp2")
    assert card.data_parallel_size == 2
    reports = await reported_by_router(card, ranks=(0, 1))
    assert [r.dp_rank for r in reports] == [0, 1]


async def test_a_worker_without_prefix_caching_publishes_load_but_no_kv_events(fleet):
    card = await card_of(fleet, "agg-no-cache")
    # No KV events (routers warn that it publishes none), but its load reaches the router.
    assert card.kv_events_address is None and card.load_metrics_address
    [report] = await reported_by_router(card)
    assert (report.instance_id, report.kv_total_blocks) == (card.instance_id, 16384)

"""The standalone KV router (`python -m turbine.router`) as a real process beside a simulated
fleet: it finds the workers in discovery, registers itself, and answers best_worker over the
request plane from the workers' real KV events and load reports. On both request planes (`plane`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.procs import _start, base_env, http_text, start_mocker, stop_all, wait_until, worker_ready
from turbine.config import DiscoveryConfig, RequestPlaneConfig, make_registry
from turbine.model.prepare import DEFAULT_MODEL
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StatusReply, StopConditions
from turbine.protocol.router import (
    BEST_WORKER,
    FINISHED,
    FIRST_TOKEN,
    ROUTER_COMPONENT,
    BestWorkerReply,
    BestWorkerRequest,
    RequestNotice,
)
from turbine.runtime.errors import RemoteError
from turbine.runtime.request_plane import RequestPlaneClient

WORKERS = 4
BS = 16
GPU_BLOCKS = 2048
PREFIX = list(range(1000, 1000 + 12 * BS))  # 12 full blocks


def router_series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            worker = line.split('worker="')[1].split('"')[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module", params=["tcp", "nats"])
def plane(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, plane, nats_url):
    root = tmp_path_factory.mktemp(f"router-service-{plane}")
    env = {**base_env(str(root / "discovery")), "TURBINE_REQUEST_PLANE": plane, "TURBINE_NATS_SERVER": nats_url}
    mockers = start_mocker("rs-mockers", env, root, "--num-workers", str(WORKERS), "--speedup-ratio", "0",
                           "--block-size", str(BS), "--num-gpu-blocks", str(GPU_BLOCKS))
    router = _start("rs-router", env, root, "turbine.router", "--system-port")
    procs = [mockers, router]
    try:
        wait_until(lambda: worker_ready(mockers), 60, "mockers ready", procs)
        wait_until(lambda: "serving best_worker" in router.log_path.read_text(errors="replace"), 30,
                   "router registered", procs)
        yield {"env": env, "router": router, "mockers": mockers, "plane": RequestPlaneConfig(plane, nats_url)}
    finally:
        stop_all(procs)


async def router_address(env) -> str:
    registry = make_registry(DiscoveryConfig(file_dir=env["TURBINE_DISCOVERY_DIR"]))
    await registry.backend.start()
    try:
        for _ in range(50):
            found = [r.address for r in await registry.list_instances()
                     if r.component == ROUTER_COMPONENT and r.endpoint == BEST_WORKER]
            if found:
                return found[0]
            await asyncio.sleep(0.1)
        raise AssertionError("the router did not register in discovery")
    finally:
        await registry.backend.close()


async def ask(rp: RequestPlaneClient, address: str, req) -> BestWorkerReply:
    return [r async for r in rp.stream(address, BEST_WORKER, req, BestWorkerReply)][0]


async def notice(rp, address, endpoint, request_id) -> str:
    return [r async for r in rp.stream(address, endpoint, RequestNotice(request_id=request_id), StatusReply)][0].status


async def generate(rp, router: str, reply: BestWorkerReply, request_id: str, tokens: list[int]) -> None:
    """Serve the request on the chosen worker, telling the router how it goes."""
    req = GenerateRequest(request_id=request_id, model=DEFAULT_MODEL, token_ids=tokens,
                          stop=StopConditions(max_tokens=3, ignore_eos=True))
    first = True
    async for out in rp.stream(reply.address, reply.endpoint, req, GenerateOutput):
        if first and out.token_ids:
            assert await notice(rp, router, FIRST_TOKEN, request_id) == "success"
            first = False
    assert await notice(rp, router, FINISHED, request_id) == "success"


def test_best_worker_follows_cached_prefixes_and_survives_bad_requests(fleet):
    async def scenario():
        rp = fleet["plane"].client()
        try:
            router = await router_address(fleet["env"])
            # The router registers before its discovery watch has seen the workers: wait for them.
            for _ in range(100):
                first = await ask(rp, router, BestWorkerRequest(model=DEFAULT_MODEL, token_ids=PREFIX + [1, 2, 3],
                                                                request_id="r1"))
                if not (first.error or "").startswith("no live worker"):
                    break
                await asyncio.sleep(0.1)
            assert first.error is None and first.overlap_blocks == 0 and first.prompt_blocks == 12
            await generate(rp, router, first, "r1", PREFIX + [1, 2, 3])
            # The worker's BlockStored events reach the router's index (a query counts no load).
            query = BestWorkerRequest(model=DEFAULT_MODEL, token_ids=PREFIX + [7])
            for _ in range(100):
                if (await ask(rp, router, query)).overlap_blocks:
                    break
                await asyncio.sleep(0.1)
            again = await ask(rp, router, BestWorkerRequest(model=DEFAULT_MODEL, token_ids=PREFIX + [4, 5, 6],
                                                            request_id="r2"))
            assert again.instance_id == first.instance_id and again.overlap_blocks == 12, again
            await generate(rp, router, again, "r2", PREFIX + [4, 5, 6])

            # Bad requests: an error reply each, and the service stays up.
            empty = await ask(rp, router, BestWorkerRequest(model=DEFAULT_MODEL, token_ids=[]))
            assert empty.error == "token_ids is empty"
            unknown = await ask(rp, router, BestWorkerRequest(model="no-such-model", token_ids=[1]))
            assert "no live worker serves model 'no-such-model'" in unknown.error
            with pytest.raises(RemoteError, match="BestWorkerRequest"):
                await ask(rp, router, RequestNotice(request_id="not a best_worker request"))
            assert await notice(rp, router, FINISHED, "never-placed") == "error"
            ok = await ask(rp, router, BestWorkerRequest(model=DEFAULT_MODEL, token_ids=PREFIX))
            assert ok.error is None and ok.instance_id == first.instance_id
        finally:
            await rp.close()

    asyncio.run(scenario())
    assert fleet["router"].alive()


def test_router_metrics_carry_the_workers_load_reports(fleet):
    url = f"http://127.0.0.1:{fleet['router'].port}/metrics"
    # Every simulated worker reports its pool (also when idle: the state is re-sent now and then).
    # The previous test's requests are done, but a report sent while one still waited stands until the next
    # (seen under load in CI): wait for every worker's idle report.
    def idle_reports() -> bool:
        text = http_text(url)
        waiting = router_series(text, "turbine_router_worker_waiting_requests")
        return len(waiting) == WORKERS and set(waiting.values()) == {0}

    wait_until(idle_reports, 20, "an idle load report from every worker", [fleet["router"]])
    text = http_text(url)
    assert set(router_series(text, "turbine_router_worker_kv_total_blocks").values()) == {GPU_BLOCKS}
    assert "turbine_router_decisions_total" in text

"""The standalone router's decisions and bookkeeping, in process (the service as a real process
over the request plane is tests/integration/test_router_service.py)."""

from __future__ import annotations

import pytest

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.router import BestWorkerRequest, RequestNotice
from turbine.router.args import RouterServiceConfig, parse_router_args
from turbine.router.indexer import WorkerKey
from turbine.router.service import RouterService

BS = 16


def worker(instance_id: str, model: str = "m", component: str = "backend", namespace: str = "turbine"):
    rec = InstanceRecord(namespace=namespace, component=component, endpoint="generate", instance_id=instance_id,
                         address=f"127.0.0.1:{1000 + len(instance_id)}")
    card = ModelCard(name=model, namespace=namespace, component=component, endpoint="generate",
                     instance_id=instance_id, tokenizer_path="", context_length=4096, kv_block_size=BS,
                     total_kv_blocks=100, max_num_seqs=8, max_num_batched_tokens=512)
    return rec, card


@pytest.fixture
async def service():
    svc = RouterService(RouterServiceConfig(request_ttl_s=60))
    fleet = [worker("a"), worker("b"), worker("p1", component="prefill"), worker("x", model="other"),
             worker("elsewhere", namespace="other-ns")]
    svc.apply([r for r, _ in fleet], [c for _, c in fleet])
    yield svc
    svc.close()


async def test_a_decision_names_a_live_instance_and_its_address(service):
    reply = service.choose(BestWorkerRequest(model="other", token_ids=list(range(40))))
    assert (reply.instance_id, reply.address, reply.endpoint, reply.component) == \
        ("x", "127.0.0.1:1001", "generate", "backend")
    assert reply.prompt_blocks == 2 and reply.overlap_blocks == 0 and reply.error is None
    prefill = service.choose(BestWorkerRequest(model="m", token_ids=[1, 2, 3], component="prefill"))
    assert prefill.instance_id == "p1"


@pytest.mark.parametrize("req, message", [
    (BestWorkerRequest(model="m", token_ids=[], component="backend"), "token_ids is empty"),
    (BestWorkerRequest(model="m", token_ids=[-1], component="backend"), "between 0 and 2**32-1"),
    (BestWorkerRequest(model="nope", token_ids=[1]), "no live worker serves model 'nope'"),
    (BestWorkerRequest(model="m", token_ids=[1]), "served by components backend, prefill: name one"),
    (BestWorkerRequest(model="m", token_ids=[1], component="decode"), "no live worker in component 'decode'"),
])
async def test_bad_requests_get_an_error_reply(service, req, message):
    replies = [r async for r in service.best_worker(req, None)]
    assert len(replies) == 1 and message in replies[0].error and replies[0].instance_id == ""


async def test_placed_requests_count_as_load_until_finished(service):
    router = service._routers[("m", "backend")]
    prompt = list(range(4 * BS))
    query = service.choose(BestWorkerRequest(model="m", token_ids=prompt, component="backend"))
    assert router.kv.loads.load(WorkerKey(query.instance_id)).active_blocks == 0  # a query counts nothing
    placed = service.choose(BestWorkerRequest(model="m", token_ids=prompt, component="backend", request_id="r1"))
    assert router.kv.loads.load(WorkerKey(placed.instance_id)).prefill_tokens == 4 * BS
    with pytest.raises(ValueError, match="already placed"):
        service.choose(BestWorkerRequest(model="m", token_ids=prompt, component="backend", request_id="r1"))
    # The burst goes elsewhere while r1 is counted.
    second = service.choose(BestWorkerRequest(model="m", token_ids=prompt, component="backend", request_id="r2"))
    assert second.instance_id != placed.instance_id
    assert [r.status async for r in service.first_token(RequestNotice(request_id="r1"), None)] == ["success"]
    assert router.kv.loads.load(WorkerKey(placed.instance_id)).prefill_tokens == 0
    assert [r.status async for r in service.finished(RequestNotice(request_id="r1"), None)] == ["success"]
    assert router.kv.loads.load(WorkerKey(placed.instance_id)).active_blocks == 0
    unknown = [r async for r in service.finished(RequestNotice(request_id="r1"), None)]
    assert unknown[0].status == "error" and "unknown request_id" in unknown[0].message


async def test_requests_never_finished_expire(service, caplog):
    import time

    router = service._routers[("m", "backend")]
    placed = service.choose(BestWorkerRequest(model="m", token_ids=list(range(BS)), component="backend",
                                              request_id="lost"))
    assert service.expire(time.monotonic() + 30) == 0
    assert service.expire(time.monotonic() + 61) == 1
    assert router.kv.loads.load(WorkerKey(placed.instance_id)).active_blocks == 0
    assert "got no 'finished' within 60s" in caplog.text


async def test_departed_workers_are_not_chosen(service):
    rec, card = worker("b")
    service.apply([rec], [card])
    picks = {service.choose(BestWorkerRequest(model="m", token_ids=[i])).instance_id for i in range(5)}
    assert picks == {"b"}
    service.apply([], [])
    with pytest.raises(ValueError, match="no live worker"):
        service.choose(BestWorkerRequest(model="m", token_ids=[1]))


def test_flags():
    cfg = parse_router_args(["--router-temperature", "0.5", "--no-router-kv-events", "--namespace", "prod",
                             "--router-kv-events-deadline", "3"])
    assert (cfg.kv.temperature, cfg.kv.use_kv_events, cfg.namespace, cfg.kv.events_deadline_s) == \
        (0.5, False, "prod", 3.0)
    for bad in (["--router-temperature", "-1"], ["--router-kv-overlap-score-weight", "-2"],
                ["--router-kv-events-deadline", "0"], ["--namespace", "a/b"], ["--router-request-ttl", "0"]):
        with pytest.raises(SystemExit):
            parse_router_args(bad)


def test_the_frontend_shares_the_router_flags():
    from turbine.frontend.args import parse_frontend_args

    router = parse_frontend_args(["--router-mode", "kv", "--router-kv-events-deadline", "2",
                                  "--router-temperature", "0.1"]).router
    assert (router.mode, router.kv.events_deadline_s, router.kv.temperature) == ("kv", 2.0, 0.1)
    with pytest.raises(SystemExit):
        parse_frontend_args(["--router-kv-events-deadline", "-1"])


async def test_the_reply_names_the_rank_that_holds_the_prefix():
    from msgspec import structs

    from turbine.protocol.kv_events import BlockStored

    svc = RouterService(RouterServiceConfig())
    rec, card = worker("dp")
    svc.apply([rec], [structs.replace(card, data_parallel_size=2)])
    try:
        prompt = list(range(3 * BS))
        svc._routers[("m", "backend")].kv.index.apply(WorkerKey("dp", 1), BlockStored.from_token_ids(
            block_hashes=[1, 2, 3], parent_hash=None, token_ids=prompt, block_size=BS))
        reply = svc.choose(BestWorkerRequest(model="m", token_ids=prompt + [1], request_id="r1"))
        assert (reply.instance_id, reply.dp_rank, reply.overlap_blocks) == ("dp", 1, 3)
        # Uncached prompts go to the rank with less load: the other one, while r1 counts.
        other = svc.choose(BestWorkerRequest(model="m", token_ids=list(range(500, 500 + 3 * BS)), request_id="r2"))
        assert other.dp_rank == 0
    finally:
        svc.close()

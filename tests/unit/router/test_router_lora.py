"""Adapter-aware routing: a request for a LoRA adapter prefers a worker whose active slots hold it
(its load report's active_loras, or a request of that adapter the router sent there), in the
frontend's KV policy and in the standalone router service alike."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.protocol.load_metrics import LoadMetrics
from turbine.protocol.router import BestWorkerRequest
from turbine.router.args import RouterServiceConfig, parse_router_args
from turbine.router.config import DEFAULT_LORA_SWAP_WEIGHT, KvRouterConfig
from turbine.router.cost import LoadTracker, WorkerLoad, worker_costs
from turbine.router.indexer import WorkerKey
from turbine.router.load_consumer import LoadMetricsConsumer
from turbine.router.metrics import RouterMetrics
from turbine.router.policy import RouterConfig, make_router
from turbine.router.service import RouterService

BS = 16
A, B = WorkerKey("a"), WorkerKey("b")
PROMPT = list(range(3 * BS))


def card(instance_id: str) -> ModelCard:
    return ModelCard(name="m", namespace="turbine", component="backend", endpoint="generate",
                     instance_id=instance_id, tokenizer_path="", context_length=4096, kv_block_size=BS,
                     total_kv_blocks=100, max_num_seqs=8, max_num_batched_tokens=512)


def adapter_card(instance_id: str, lora_name: str) -> ModelCard:
    """The card a worker publishes for an adapter it holds."""
    return msgspec.structs.replace(card(instance_id), name=lora_name, lora_name=lora_name, lora_id=1, base_model="m")


def record(instance_id: str) -> InstanceRecord:
    return InstanceRecord(namespace="turbine", component="backend", endpoint="generate", instance_id=instance_id,
                          address=f"127.0.0.1:{1000 + len(instance_id)}")


def report(instance_id: str, active_blocks: int, loras: list[str], max_loras: int = 2) -> LoadMetrics:
    return LoadMetrics(instance_id=instance_id, kv_active_blocks=active_blocks, kv_total_blocks=100, num_running=1,
                       num_waiting=0, max_loras=max_loras, active_loras=loras)


def test_a_worker_without_the_adapter_active_costs_the_swap_weight_more():
    loads = {A: WorkerLoad(), B: WorkerLoad()}
    plain = worker_costs({}, loads, 3 * BS, BS, 4.0)
    costs = worker_costs({}, loads, 3 * BS, BS, 4.0, lora_swaps={A: 1, B: 0}, lora_swap_weight=10.0)
    assert costs[A] == plain[A] + 10.0 and costs[B] == plain[B]
    assert worker_costs({}, loads, 3 * BS, BS, 4.0, {A: 2}, 10.0)[A] == plain[A] + 20.0


def test_a_worker_whose_slots_all_serve_other_adapters_costs_two_swaps():
    tracker = LoadTracker()
    tracker.report(A, report("a", 0, ["x", "y"], max_loras=2))
    assert tracker.lora_swaps(A, "x") == 0 and tracker.lora_swaps(A, "z") == 1  # x, y idle in their slots
    tracker.add("r1", A, prefill_tokens=10, blocks=1, lora_name="x")
    assert tracker.lora_swaps(A, "z") == 1  # one slot still free of unfinished requests
    tracker.add("r2", A, prefill_tokens=10, blocks=1, lora_name="w")
    assert tracker.lora_swaps(A, "z") == 2 and tracker.lora_swaps(A, "w") == 0  # z would wait for a slot
    tracker.free("r2")
    assert tracker.lora_swaps(A, "z") == 1
    assert tracker.lora_swaps(B, "z") == 1  # no report: slots unknown
    tracker.add("r3", A, prefill_tokens=10, blocks=1, lora_name="v")
    assert tracker.lora_swaps(A, "y") == 2  # the report lists y, but x and v (unfinished) hold both slots


def test_the_tracker_knows_an_adapter_from_reports_and_from_its_own_unfinished_requests():
    tracker = LoadTracker()
    tracker.report(A, report("a", 0, ["x"]))
    assert tracker.lora_active(A, "x") and not tracker.lora_active(A, "y") and not tracker.lora_active(B, "x")
    tracker.add("r1", B, prefill_tokens=10, blocks=1, lora_name="y")
    tracker.add("r2", B, prefill_tokens=10, blocks=1, lora_name="y")
    assert tracker.lora_active(B, "y")
    tracker.free("r1")
    assert tracker.lora_active(B, "y")
    tracker.prefill_done("r2")
    tracker.report(B, report("b", 1, []))  # handed over: still counted until it finishes
    assert tracker.lora_active(B, "y")
    tracker.free("r2")
    assert not tracker.lora_active(B, "y")
    tracker.add("r3", B, prefill_tokens=10, blocks=1, lora_name="z")
    tracker.forget_instance("b")
    assert not tracker.lora_active(B, "z")


@pytest.fixture(params=[DEFAULT_LORA_SWAP_WEIGHT, 0.0], ids=["aware", "off"])
async def frontend_router(request):
    """The frontend's KV policy over workers a and b; a reports adapter x active but 4 blocks more load."""
    cfg = RouterConfig(mode="kv", kv=KvRouterConfig(lora_swap_weight=request.param))
    router = make_router(cfg, card("a"), RouterMetrics(CollectorRegistry()))  # metrics in a private registry
    router.instances_changed([record("a"), record("b")], {"a": card("a"), "b": card("b")})
    router.core.kv.loads.report(A, report("a", 4, ["x"]))
    router.core.kv.loads.report(B, report("b", 0, ["y"]))
    yield router, request.param
    router.core.close()


async def test_the_frontends_kv_policy_prefers_the_worker_with_the_adapter_active(frontend_router):
    router, weight = frontend_router
    chosen = router.select([record("a"), record("b")], GenerateRequest(request_id="r", model="m", token_ids=PROMPT,
                                                                       lora_name="x"))
    # With the term, a (x active) wins despite its load; without it the idle b does.
    assert chosen.instance.instance_id == ("a" if weight else "b")
    decisions = router.core.metrics.lora_decisions
    assert decisions.labels("m", "true" if weight else "false")._value.get() == 1  # /metrics tells which


async def test_requests_of_one_adapter_stay_together_before_any_report_shows_it():
    router = make_router(RouterConfig(mode="kv"), card("a"), None)
    router.instances_changed([record("a"), record("b")], {"a": card("a"), "b": card("b")})
    try:
        first = router.select([record("a"), record("b")], GenerateRequest(request_id="r0", model="m",
                                                                           token_ids=PROMPT, lora_name="x"))
        for i in range(1, 4):  # by load alone they would alternate (each adds 16 blocks of cost where it goes)
            again = router.select([record("a"), record("b")], GenerateRequest(
                request_id=f"r{i}", model="m", token_ids=[7 + i] * (3 * BS), lora_name="x"))
            assert again.instance == first.instance
        other = router.select([record("a"), record("b")], GenerateRequest(request_id="o", model="m",
                                                                          token_ids=PROMPT, lora_name="y"))
        assert other.instance != first.instance
    finally:
        router.core.close()


@pytest.mark.parametrize("weight", [DEFAULT_LORA_SWAP_WEIGHT, 0.0], ids=["aware", "off"])
async def test_the_router_service_prefers_the_worker_with_the_adapter_active(weight):
    svc = RouterService(RouterServiceConfig(kv=KvRouterConfig(lora_swap_weight=weight)))
    svc.apply([record("a"), record("b")], [card("a"), card("b"), adapter_card("a", "x"), adapter_card("b", "x")])
    try:
        loads = svc._routers[("m", "backend")].kv.loads
        loads.report(A, report("a", 4, ["x"]))
        loads.report(B, report("b", 0, ["y"]))
        for req in (BestWorkerRequest(model="m", token_ids=PROMPT, lora_name="x"),
                    BestWorkerRequest(model="x", token_ids=PROMPT)):  # the adapter named as the model
            reply = svc.choose(req)
            assert reply.error is None and reply.instance_id == ("a" if weight else "b")
    finally:
        svc.close()


def test_the_flag_in_both_hosts():
    from turbine.frontend.args import parse_frontend_args

    assert parse_router_args(["--router-lora-swap-weight", "7"]).kv.lora_swap_weight == 7.0
    assert parse_frontend_args(["--router-mode", "kv", "--router-lora-swap-weight", "0"]).router.kv.lora_swap_weight \
        == 0.0
    assert parse_router_args([]).kv.lora_swap_weight == DEFAULT_LORA_SWAP_WEIGHT
    with pytest.raises(SystemExit):
        parse_router_args(["--router-lora-swap-weight", "-1"])


def test_reports_with_more_adapters_than_slots_are_dropped():
    tracker = LoadTracker()
    consumer = LoadMetricsConsumer(tracker)
    consumer._address_of["a"] = "tcp://127.0.0.1:1"  # followed (no socket needed to apply a report)
    try:
        consumer.apply(report("a", 1, ["x", "y", "z"], max_loras=2))
        consumer.apply(report("a", 1, [], max_loras=10**9))
        assert consumer.rejected == 2 and tracker.reported(A) is None
        consumer.apply(report("a", 1, ["x", "y"], max_loras=2))
        assert tracker.reported(A).active_loras == ["x", "y"]
    finally:
        consumer._address_of.clear()
        consumer.close()

"""Busy thresholds and the frontend's request queue (turbine/frontend/models/busy_queue.py): a request goes
only to a worker below the thresholds, waits in order while every worker is busy, goes to a worker
that joins, and gets 503 when the queue is full; the model table shares the queue across snapshots
and with the base model's adapters. A real request-plane server stands in for the worker."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.frontend.dispatch.test_dispatch import Run, instance, served
from tests.unit.frontend.dispatch.test_frontend_disagg import Registry, adapter, card, record
from turbine.config import ConfigError
from turbine.frontend.args import build_parser, frontend_config_from_args
from turbine.frontend.errors import Overloaded
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models.busy_queue import BusyConfig, BusyQueue, QueueFull
from turbine.frontend.models.table import ModelTable
from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions, Usage
from turbine.router.policy import RoundRobinRouter
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer


class HeldWorker:
    """Answers one token when the test releases the request; records how many it held at once."""

    def __init__(self, tokenizer):
        self.token = tokenizer.encode(" ok", add_special_tokens=False)
        self.release = asyncio.Event()
        self.active = self.most = 0
        self.got: list[str] = []

    async def generate(self, req: GenerateRequest, ctx):
        self.active += 1
        self.most = max(self.most, self.active)
        self.got.append(req.request_id)
        try:
            await self.release.wait()
            yield GenerateOutput(token_ids=self.token, finish_reason="length",
                                 usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=1))
        finally:
            self.active -= 1


def req(rid: str, tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", token_ids=list(range(1, tokens + 1)),
                           stop=StopConditions(max_tokens=1))


async def until(cond, what: str):
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_busy_worker_gets_no_more_requests_and_the_rest_wait_in_order(tokenizer):
    worker = HeldWorker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    model = served(tokenizer, [instance("w", server.address)])
    model.busy_queue = BusyQueue(BusyConfig(requests=1))
    model.busy_queue.set_instances({"m": model.instances})
    metrics, client = FrontendMetrics(), RequestPlaneClient()
    try:
        runs = [asyncio.create_task(Run(model, client, req(f"r{i}"), metrics).text()) for i in range(3)]
        await until(lambda: worker.got == ["r0"] and model.busy_queue.queued == 2, "r0 served, two waiting")
        assert metrics.queued.labels("m")._value.get() == 2
        worker.release.set()  # each answer frees the worker for the next in line
        assert await asyncio.gather(*runs) == [" ok"] * 3
        assert worker.got == ["r0", "r1", "r2"] and worker.most == 1  # never two at once on it
        assert metrics.queue_wait.labels("m")._sum.get() > 0 and model.busy_queue.queued == 0
        assert not model.busy_queue.busy("w")  # every request uncounted at its end
    finally:
        await client.close()
        await server.stop()


async def test_a_full_queue_is_503(tokenizer):
    worker = HeldWorker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    model = served(tokenizer, [instance("w", server.address)])
    model.busy_queue = BusyQueue(BusyConfig(requests=1, queue_size=0))
    model.busy_queue.set_instances({"m": model.instances})
    metrics, client = FrontendMetrics(), RequestPlaneClient()
    try:
        first = asyncio.create_task(Run(model, client, req("r0"), metrics).text())
        await until(lambda: worker.got == ["r0"], "r0 served")
        with pytest.raises(Overloaded) as info:  # (the bound only keeps it from hanging if it reached the worker)
            await asyncio.wait_for(Run(model, client, req("r1"), metrics).text(), 30)
        assert info.value.status == 503 and "--busy-queue-size" in info.value.message
        assert metrics.queue_full.labels("m")._value.get() == 1
        worker.release.set()
        assert await first == " ok"
    finally:
        await client.close()
        await server.stop()


async def test_prompt_token_threshold_and_a_joining_worker_drains_the_queue():
    q = BusyQueue(BusyConfig(prompt_tokens=100))
    a, b = instance("a", "127.0.0.1:1"), instance("b", "127.0.0.1:2")
    q.set_instances({"m": [a]})
    assert [i.instance_id for i in await q.admit("m", 500)] == ["a"]  # an idle worker takes any prompt
    q.add("a", 60)
    assert [i.instance_id for i in await q.admit("m", 40)] == ["a"]  # 60 + 40 within 100 tokens
    waiter = asyncio.create_task(q.admit("m", 41))  # 60 + 41 would pass it
    await asyncio.sleep(0.01)
    assert q.queued == 1 and not waiter.done()
    q.set_instances({"m": [a, b]})  # a worker joined (the planner's scale-up)
    assert [i.instance_id for i in await waiter] == ["b"]
    q.remove("a", 60)
    assert not q.busy("a", 1000)


async def test_fifo_a_newcomer_does_not_pass_the_waiters_and_a_leaver_passes_its_turn():
    q = BusyQueue(BusyConfig(requests=1))
    q.set_instances({"m": [instance("a", "127.0.0.1:1")]})
    order = []

    async def take(name):  # as dispatch: admitted, then counted on its worker in the same step
        pool = await q.admit("m")
        q.add(pool[0].instance_id, 1)
        order.append(name)

    q.add("a", 1)
    first, second = asyncio.create_task(take("first")), asyncio.create_task(take("second"))
    await asyncio.sleep(0.01)
    first.cancel()  # its client went away
    await asyncio.sleep(0.01)
    q.remove("a", 1)  # free: `second` is woken
    newcomer = asyncio.create_task(take("newcomer"))  # arrives before `second` looked
    await second
    await asyncio.sleep(0.01)
    assert order == ["second"] and not newcomer.done() and q.queued == 1
    q.remove("a", 1)
    await newcomer
    assert order == ["second", "newcomer"] and q.queued == 0
    full = BusyQueue(BusyConfig(requests=1, queue_size=0))
    full.set_instances({"m": [instance("a", "127.0.0.1:1")]})
    full.add("a", 1)
    with pytest.raises(QueueFull):
        await full.admit("m")


async def test_no_live_worker_does_not_wait():
    q = BusyQueue(BusyConfig(requests=1))
    assert await q.admit("m") == []


async def test_the_model_table_keeps_one_queue_for_a_model_and_its_adapters(tokenizer, monkeypatch):
    table = ModelTable(Registry(), lambda c: RoundRobinRouter(), busy=BusyConfig(requests=2))

    async def fake_tokenizer(c):
        return tokenizer

    monkeypatch.setattr(table, "_tokenizer", fake_tokenizer)
    d1 = card("d1")
    await table._apply([record(d1)], [d1, adapter(d1, "sql")])
    queue = table.models["m"].busy_queue
    assert queue is not None and table.models["sql"].busy_queue is queue
    assert {k: [i.instance_id for i in v] for k, v in queue.instances.items()} == {"m": ["d1"], "sql": ["d1"]}
    d2 = card("d2")
    await table._apply([record(d1), record(d2)], [d1, d2])
    assert table.models["m"].busy_queue is queue and [i.instance_id for i in queue.instances["m"]] == ["d1", "d2"]
    assert ModelTable(Registry(), lambda c: RoundRobinRouter()).busy.enabled is False


def test_flags():
    p = build_parser()
    cfg = frontend_config_from_args(p.parse_args(["--busy-threshold-requests", "4",
                                                  "--busy-threshold-prompt-tokens", "3000",
                                                  "--busy-queue-size", "10"]), p)
    assert cfg.busy == BusyConfig(requests=4, prompt_tokens=3000, queue_size=10)
    assert not frontend_config_from_args(p.parse_args([]), p).busy.enabled
    with pytest.raises(SystemExit):  # a queue bound without a threshold would do nothing: refused
        frontend_config_from_args(p.parse_args(["--busy-queue-size", "10"]), p)
    for bad in (["--busy-threshold-requests", "0"], ["--busy-threshold-prompt-tokens", "-1"]):
        with pytest.raises(SystemExit):
            frontend_config_from_args(p.parse_args(bad), p)
    with pytest.raises(ConfigError, match="busy_queue_size|queue_size"):
        BusyConfig(queue_size=3)

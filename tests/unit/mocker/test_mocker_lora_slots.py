"""Simulated LoRA slots: a step holds requests of at most max_loras distinct adapters (others wait),
the slots are an LRU, each swap costs --lora-load-time-ms, and the load report names the slots."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from turbine.mocker.args import parse_mocker_args
from turbine.mocker.engine import MockEngine
from turbine.mocker.handlers import AggregatedHandlers
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.scheduler import Scheduler, Sequence
from turbine.mocker.timing import TimingProfile
from turbine.mocker.tokens import Choice, TokenSampler
from turbine.protocol.generate import GenerateRequest, StopConditions
from turbine.runtime.errors import AdapterNotLoaded
from turbine.worker.lora_slots import LoraSlots
from turbine.worker.worker_metrics import WorkerMetrics

SAMPLER = TokenSampler(1000, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)


def scheduler(max_loras: int) -> Scheduler:
    return Scheduler(BlockPool(256, 16), SAMPLER, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4096,
                     lora_slots=LoraSlots(max_loras))


def seq(name: str, lora: str | None, max_tokens: int = 4) -> Sequence:
    prompt = [100 + sum(map(ord, name))] * 20
    choice = Choice(seed=1, index=0, min_tokens=0, stop_token_ids=frozenset(), ignore_eos=True)
    return Sequence(seq_id=name, choice=choice, tokens=list(prompt), num_prompt_tokens=len(prompt),
                    max_tokens=max_tokens, lora_name=lora)


def test_a_step_holds_at_most_max_loras_adapters_and_the_rest_wait_in_place():
    s = scheduler(2)
    seqs = [seq("a1", "a"), seq("b1", "b"), seq("c1", "c"), seq("base", None), seq("a2", "a")]
    for x in seqs:
        s.add(x)
    step = s.schedule()
    assert [x.seq_id for x, _ in step.scheduled] == ["a1", "b1", "base", "a2"]
    assert step.lora_swaps == 2 and s.lora_slots.resident == ("a", "b")
    assert [x.seq_id for x in s.waiting] == ["c1"]  # it waits for a free slot
    while s.running:  # the a and b requests finish
        s.complete(s.schedule())
    step = s.schedule()
    assert [x.seq_id for x, _ in step.scheduled] == ["c1"] and step.lora_swaps == 1
    assert set(s.lora_slots.resident) == {"c", "a"} or set(s.lora_slots.resident) == {"c", "b"}
    assert s.lora_slots.swaps == 3


def test_an_adapter_in_a_slot_costs_no_swap_and_the_lru_one_leaves():
    s = scheduler(2)
    for name, lora in (("a1", "a"), ("b1", "b")):
        s.add(seq(name, lora, max_tokens=1))
        s.complete(s.schedule())
    s.add(seq("a2", "a", max_tokens=1))
    assert s.schedule().lora_swaps == 0  # a is in a slot: no swap, and now the most recent
    s.running.clear()
    s.add(seq("c1", "c", max_tokens=1))
    assert s.schedule().lora_swaps == 1 and s.lora_slots.resident == ("a", "c")  # b was least recently used


@contextlib.asynccontextmanager
async def worker(load_ms: float, speedup: float = 1.0):
    sched = scheduler(1)
    timing = TimingProfile(step_base_ms=1.0, prefill_ms_per_token=0, prefill_ms_per_token_pair=0,
                           decode_ms_per_seq=0, decode_ms_per_kv_token=0)
    engine = MockEngine(sched, timing, speedup, lora_load_ms=load_ms)
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": str(id(engine))})
    task = asyncio.create_task(engine.run())
    try:
        handlers = AggregatedHandlers([engine], metrics, vocab_size=1000)
        handlers.adapters.update(a=1, b=2)  # loaded (the worker host's LoRA manager does this)
        yield handlers
    finally:
        task.cancel()


async def run(h, lora: str | None) -> float:
    req = GenerateRequest(request_id="r", model="m", token_ids=[5] * 8, lora_name=lora,
                          stop=StopConditions(max_tokens=1, ignore_eos=True))
    started = time.monotonic()
    async for _ in h.generate(req, None):
        pass
    return time.monotonic() - started


async def test_each_swap_costs_the_load_time_before_the_prefill():
    async with worker(load_ms=150.0) as h:
        swapped = [await run(h, lora) for lora in ("a", "b", "a")]  # one slot: every request swaps
        resident = [await run(h, "a") for _ in range(2)]
        assert h.engines[0].scheduler.lora_slots.swaps == 3
    assert min(swapped) >= 0.145 and max(resident) < 0.145


async def test_unknown_adapters_are_refused():
    async with worker(load_ms=0) as h:
        with pytest.raises(AdapterNotLoaded, match="no such LoRA adapter is loaded on this worker"):
            await run(h, "zzz")


def test_lora_slot_flags(capsys):
    cfg = parse_mocker_args(["--enable-lora", "--max-loras", "2", "--lora-load-time-ms", "5"])
    assert (cfg.lora_slots, cfg.lora_load_ms) == (2, 5.0)
    assert parse_mocker_args(["--enable-lora"]).lora_slots == 1  # vLLM's default max_loras
    assert parse_mocker_args([]).lora_slots == 0
    for argv, flag in ((["--max-loras", "2"], "--max-loras"),  # without --enable-lora: refused, not ignored
                       (["--lora-load-time-ms", "3"], "--lora-load-time-ms"),
                       (["--enable-lora", "--max-loras", "0"], "--max-loras"),
                       (["--enable-lora", "--lora-load-time-ms", "-1"], "--lora-load-time-ms")):
        with pytest.raises(SystemExit):
            parse_mocker_args(argv)
        assert flag in capsys.readouterr().err

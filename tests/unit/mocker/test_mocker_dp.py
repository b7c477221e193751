"""The mocker's data parallelism: each simulated worker runs --data-parallel-size engines
(ranks), each with its own block pool, scheduler, KV events (tagged with its rank) and load
reports; a request's dp_rank picks the engine, none given: the least loaded."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from turbine.mocker.args import parse_mocker_args
from turbine.mocker.engine import MockEngine
from turbine.mocker.handlers import AggregatedHandlers
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.scheduler import Scheduler
from turbine.mocker.timing import TimingProfile
from turbine.mocker.tokens import TokenSampler
from turbine.mocker.worker import SimulatedWorker, WorkerEngines
from turbine.protocol.generate import GenerateRequest, StopConditions
from turbine.runtime.errors import InvalidRequest
from turbine.runtime.event_plane import WorkerEventPlane
from turbine.runtime.status_server import Health
from turbine.worker.worker_metrics import WorkerMetrics

PROMPT = list(range(100, 140))


@contextlib.asynccontextmanager
async def two_ranks(speedup: float = 0.0):
    sampler = TokenSampler(1000, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)
    engines = [MockEngine(Scheduler(BlockPool(64, 16), sampler, max_num_seqs=8, max_num_batched_tokens=256,
                                    max_model_len=1024), TimingProfile(), speedup) for _ in range(2)]
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": f"dp-{id(engines)}"})
    tasks = [asyncio.create_task(e.run()) for e in engines]
    try:
        yield AggregatedHandlers(engines, metrics, vocab_size=1000)
    finally:
        for t in tasks:
            t.cancel()


def request(dp_rank=None, max_tokens=2, prompt=PROMPT) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=list(prompt), dp_rank=dp_rank,
                           stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))


async def test_the_requests_dp_rank_picks_the_engine():
    async with two_ranks() as h:
        [c async for c in h.generate(request(dp_rank=1), None)]
        pools = [e.scheduler.pool for e in h.engines]
        assert not pools[0].cached and pools[1].cached  # the prompt's blocks are on rank 1 only
        second = [c async for c in h.generate(request(dp_rank=1), None)]
        assert second[-1].usage.cached_tokens == 32  # rank 1's prefix cache served it


async def test_without_a_rank_the_least_loaded_engine_serves():
    async with two_ranks(speedup=1.0) as h:  # real step times: the first request is still running
        first = h.generate(request(max_tokens=500), None)
        await anext(first)
        [busy] = [e for e in h.engines if e.scheduler.num_unfinished]
        served = []
        for engine in h.engines:
            engine.submit = _recording(engine, served)
        [c async for c in h.generate(request(prompt=[5, 6, 7]), None)]
        assert served and busy not in served
        await first.aclose()


def _recording(engine: MockEngine, served: list):
    submit = engine.submit

    def recorded(seqs):
        served.append(engine)
        return submit(seqs)

    return recorded


async def test_a_rank_out_of_range_is_an_invalid_request():
    async with two_ranks() as h:
        for rank in (2, -1):
            with pytest.raises(InvalidRequest, match=f"dp_rank {rank}"):
                [c async for c in h.generate(request(dp_rank=rank), None)]


async def test_a_worker_publishes_kv_events_and_load_per_rank(model_dir):
    cfg = parse_mocker_args(["--data-parallel-size", "2", "--speedup-ratio", "0"])
    info = cfg.model_info
    sampler = TokenSampler(info.vocab_size, info.eos_token_ids, info.special_token_ids, 0)
    w = SimulatedWorker(cfg, WorkerEngines(cfg, sampler), Health(), WorkerEventPlane("zmq", "127.0.0.1"), "w")
    tasks = [asyncio.create_task(e.run()) for e in w.engines]
    try:
        assert w.card.data_parallel_size == 2 and len(w.engines) == 2
        assert [p.dp_rank for p in w.events.kv] == [0, 1]
        prompt = list(range(1000, 1200))  # 3 full blocks of 64
        [c async for c in w.handlers.generate(request(dp_rank=1, prompt=prompt), None)]
        assert w.events.kv[0].next_event_id == 0 and w.events.kv[1].next_event_id > 0
        assert set(w.events.load._sent) == {0, 1}  # each rank's load is reported
        # The idle state after the request may be held back by the publisher's minimum interval: wait for it.
        for _ in range(100):
            if w.events.load._sent[1][0] == 0:
                break
            await asyncio.sleep(0.05)
        assert w.events.load._sent[1][0] == 0 and w.events.load.published >= 2
        assert await w.canary() is None  # every rank generates
    finally:
        for t in tasks:
            t.cancel()
        w.close()


def test_data_parallel_size_flag_is_checked(capsys):
    with pytest.raises(SystemExit):
        parse_mocker_args(["--data-parallel-size", "0"])
    assert "--data-parallel-size" in capsys.readouterr().err

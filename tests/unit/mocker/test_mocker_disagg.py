"""The mocker in disaggregated serving: prefill workers compute one token and hand over the
prompt's KV; decode workers pull it (blocks held, nothing scheduled, for the simulated transfer
time), recompute only the last prompt token, and generate what an aggregated worker would.
Blocks never leak, whatever is cancelled or preempted while KV is in transit."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbine.mocker.args import parse_mocker_args
from turbine.mocker.engine import MockEngine
from turbine.mocker.handlers import HANDLERS_OF_ROLE, Handlers
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.kv_transfer import KvTransferModel, kv_bytes_per_token
from turbine.mocker.scheduler import FINISHED, PULLING, WAITING, Scheduler, Sequence
from turbine.mocker.timing import TimingProfile
from turbine.mocker.tokens import Choice, TokenSampler, prompt_seed
from turbine.mocker.worker import SimulatedWorker, WorkerEngines
from turbine.protocol.generate import GenerateRequest, SamplingOptions, StopConditions, StructuredOutputs
from turbine.protocol.kv_events import BlockRemoved, BlockStored
from turbine.runtime.errors import InvalidRequest
from turbine.runtime.event_plane import WorkerEventPlane
from turbine.runtime.status_server import Health
from turbine.worker.worker_metrics import WorkerMetrics

EOS = 2
PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and a partial one
NO_STEP_TIME = TimingProfile(step_base_ms=0, prefill_ms_per_token=0, prefill_ms_per_token_pair=0,
                             decode_ms_per_seq=0, decode_ms_per_kv_token=0)
_ids = itertools.count()


@contextlib.asynccontextmanager
async def worker(mode: str = "agg", *, speedup: float = 0.0, transfer: KvTransferModel | None = None,
                 natural_output_len: int = 0):
    sampler = TokenSampler(1000, eos_token_ids=[EOS], special_token_ids=[0, 1, 2],
                           natural_output_len=natural_output_len)
    scheduler = Scheduler(BlockPool(256, 16), sampler, max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=4096)
    engine = MockEngine(scheduler, NO_STEP_TIME, speedup, kv_transfer=transfer)
    worker_id = f"{mode}-{next(_ids)}"
    metrics = WorkerMetrics({"namespace": "t", "component": mode, "model": "m", "worker_id": worker_id})
    task = asyncio.create_task(engine.run())
    try:
        yield HANDLERS_OF_ROLE[mode]([engine], metrics, vocab_size=1000, instance_id=worker_id)
    finally:
        task.cancel()


def request(prompt=PROMPT, n=1, kv_transfer_params=None, **stop) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=list(prompt), sampling=SamplingOptions(n=n),
                           stop=StopConditions(**stop), kv_transfer_params=kv_transfer_params)


async def chunks(handlers: Handlers, req: GenerateRequest):
    return [c async for c in handlers.generate(req, None)]


def tokens_of(out, index=0) -> list[int]:
    return [t for c in out if c.index == index for t in c.token_ids]


async def prefill(handlers: Handlers, prompt=PROMPT) -> dict:
    [last] = [c for c in await chunks(handlers, request(prompt, max_tokens=50)) if c.finish_reason]
    return last.kv_transfer_params


# ---------------------------------------------------------------- prefill workers

async def test_a_prefill_worker_computes_one_token_and_hands_over_the_prompt_blocks():
    async with worker("prefill") as p:
        [last] = await chunks(p, request(max_tokens=50, min_tokens=20, ignore_eos=True))
        probe = make_seq(PROMPT, 1)
        p.engines[0].scheduler.add(probe)  # only to get the prompt's block hashes
        p.engines[0].scheduler.waiting.remove(probe)
        cached = p.engines[0].scheduler.pool.lookup(probe.hashes)
    assert len(last.token_ids) == 1 and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 1)
    params = last.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.instance_id
    assert params["remote_request_id"].startswith("r-")  # the engine-side id, unique per attempt
    assert params["remote_num_tokens"] == 40
    assert len(params["remote_block_ids"]) == 3  # ceil(40 / 16): every block the prompt filled
    assert params["remote_block_ids"][:2] == cached  # the two full ones stay in its prefix cache


async def test_a_prefill_worker_refuses_n_above_one():
    async with worker("prefill") as p:
        with pytest.raises(InvalidRequest, match="n=2"):
            await chunks(p, request(n=2, max_tokens=5))
        ok = await chunks(p, request(n=1, max_tokens=5))
    assert ok[-1].finish_reason == "length" and ok[-1].kv_transfer_params is not None


async def test_only_prefill_workers_attach_kv_transfer_params():
    async with worker("agg") as a, worker("decode") as d:
        for h in (a, d):
            out = await chunks(h, request(max_tokens=3, ignore_eos=True))
            assert len(tokens_of(out)) == 3 and all(c.kv_transfer_params is None for c in out)


# ---------------------------------------------------------------- decode workers

async def test_decode_with_pulled_kv_generates_what_aggregated_does_and_counts_the_prompt_as_cached():
    prompts = [PROMPT, list(range(500, 517)), [7], list(range(300, 364))]  # 40, 17, 1, 64 (whole blocks)
    async with worker("prefill", natural_output_len=12) as p, worker("decode", natural_output_len=12) as d, \
            worker("agg", natural_output_len=12) as a:
        for prompt in prompts:
            for k, stop in enumerate(({"max_tokens": 30}, {"max_tokens": 30, "ignore_eos": True},
                                      {"max_tokens": 30, "min_tokens": 20})):
                params = await prefill(p, prompt)
                pulled = await chunks(d, request(prompt, n=2, kv_transfer_params=params, **stop))
                local = await chunks(d, request(prompt, n=2, **stop))
                agg = await chunks(a, request(prompt, n=2, **stop))
                for i in (0, 1):
                    assert tokens_of(pulled, i) == tokens_of(agg, i) == tokens_of(local, i), (prompt, stop)
                usage = [c.usage for c in pulled if c.usage]
                # As vLLM reports it: the decode worker's own prefix-cache hit, not the pulled
                # tokens (cold on the first pull; the local run then cached the prompt's full blocks).
                local_hit = 0 if k == 0 else (len(prompt) - 1) // 16 * 16
                assert [u.cached_tokens for u in usage] == [local_hit] * 2
            d.engines[0].scheduler.pool.reset()
            [cold] = [c.usage for c in await chunks(d, request(prompt, max_tokens=2)) if c.usage]
            assert cold.cached_tokens == 0  # without transfer params: a local prefill
        assert d.engines[0].scheduler.pool.num_in_use == 0


async def test_params_that_ask_for_no_remote_prefill_mean_a_local_prefill():
    async with worker("decode") as d:
        for params in ({"do_remote_prefill": False, "do_remote_decode": True}, {}):
            [last] = [c for c in await chunks(d, request(max_tokens=2, kv_transfer_params=params)) if c.usage]
            assert last.usage.cached_tokens == 0
            d.engines[0].scheduler.pool.reset()


async def test_the_pull_takes_the_simulated_transfer_time_scaled_by_the_speedup_ratio():
    # 40 tokens x 1000 bytes at 1 MB/s = 40 ms, at speedup 0.1: 400 ms. Steps take no time.
    transfer = KvTransferModel(bytes_per_token=1000, bandwidth_bytes_per_s=1e6)
    async with worker("prefill") as p, worker("decode", speedup=0.1, transfer=transfer) as d:
        params = await prefill(p)
        sched = d.engines[0].scheduler
        started = time.monotonic()
        task = asyncio.create_task(chunks(d, request(max_tokens=3, ignore_eos=True, kv_transfer_params=params)))
        await asyncio.sleep(0.05)
        # In transit: the blocks for the whole prompt are held, nothing has been computed.
        [seq] = sched.pulling
        assert seq.status == PULLING and seq.num_pull_tokens == 40 and not task.done()
        assert sched.pool.num_in_use == 3 and not sched.running
        assert sched.num_queued == 0  # the load report's waiting count: it holds its blocks, it queues for nothing
        out = await task
        elapsed = time.monotonic() - started
        assert elapsed >= 0.395  # a lower bound: a busy machine can only make it longer
        assert tokens_of(out) and sched.pool.num_in_use == 0


async def test_with_speedup_zero_the_pull_is_instant():
    transfer = KvTransferModel(bytes_per_token=10**9, bandwidth_bytes_per_s=1.0)  # 1e9 s per token, unscaled
    async with worker("prefill") as p, worker("decode", speedup=0.0, transfer=transfer) as d:
        params = await prefill(p)
        out = await asyncio.wait_for(chunks(d, request(max_tokens=3, kv_transfer_params=params)), 5)
    assert len(tokens_of(out)) == 3


async def test_cancelling_during_the_transfer_frees_the_blocks_at_once():
    slow = KvTransferModel(bytes_per_token=10**6, bandwidth_bytes_per_s=1e6)  # 40 s for the prompt
    async with worker("prefill") as p, worker("decode", speedup=1.0, transfer=slow) as d:
        params = await prefill(p)
        sched = d.engines[0].scheduler
        task = asyncio.create_task(chunks(d, request(max_tokens=3, kv_transfer_params=params)))
        async with asyncio.timeout(5):
            while not sched.pulling:
                await asyncio.sleep(0.001)
        assert sched.pool.num_in_use == 3
        task.cancel()  # what the request plane does when the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert sched.pool.num_in_use == 0 and not sched.has_work() and not d.engines[0]._pulls
        # The engine still serves, and a later pull of the same prompt is not confused by it.
        d.engines[0].speedup_ratio = 0
        out = await chunks(d, request(max_tokens=3, kv_transfer_params=params))
        assert len(tokens_of(out)) == 3 and sched.pool.num_in_use == 0


# ---------------------------------------------------------------- property: no leaks with pulls

SAMPLER = TokenSampler(500, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)


def make_seq(prompt: list[int], max_tokens: int, *, pull: bool = False, index: int = 0) -> Sequence:
    choice = Choice(seed=prompt_seed(prompt), index=index, min_tokens=0, stop_token_ids=frozenset(),
                    ignore_eos=True)
    return Sequence(seq_id=f"s{next(_ids)}", choice=choice, tokens=list(prompt), num_prompt_tokens=len(prompt),
                    max_tokens=max_tokens, kv_to_pull=pull)


class CacheMirror:
    """The prefix cache as its events describe it."""

    def __init__(self):
        self.hashes: set[int] = set()

    def __call__(self, ev) -> None:
        if isinstance(ev, BlockStored):
            self.hashes |= set(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            self.hashes -= set(ev.block_hashes)
        else:
            self.hashes.clear()


def check_consistent(sched: Scheduler, mirror: CacheMirror) -> None:
    pool = sched.pool
    landed = [bool(seq.blocks) for seq in sched.waiting]
    assert landed == sorted(landed, reverse=True), "a landed sequence waits behind another"
    for seq in sched.waiting:  # only a sequence whose pulled KV landed waits holding blocks
        assert not seq.blocks or (seq.num_computed == len(seq.tokens) - 1 and not seq.kv_to_pull)
    assert sched.num_queued == landed.count(False)
    holders = Counter(b for s in (*sched.running, *sched.pulling, *sched.waiting) for b in s.blocks)
    assert pool.ref_counts == [holders[b] for b in range(pool.num_blocks)]
    in_use = {b for b, r in enumerate(pool.ref_counts) if r > 0}
    empty, evictable = set(pool.empty), set(pool.evictable)
    assert not (in_use & empty or in_use & evictable or empty & evictable)
    assert len(in_use) + len(empty) + len(evictable) == pool.num_blocks
    assert pool.cached == {h: b for b, h in enumerate(pool.block_hashes) if h is not None}
    assert mirror.hashes == set(pool.cached)
    for seq in sched.pulling:  # their blocks' contents are not there yet: nobody can hit them
        assert all(pool.block_hashes[b] is None for b in seq.blocks[seq.num_cached_blocks:])


BASE = [10 + (i * 7) % 400 for i in range(40)]
add_op = st.tuples(st.just("add"), st.booleans(), st.integers(0, 40), st.integers(1, 30), st.integers(1, 30),
                   st.integers(1, 2))
land_op = st.tuples(st.just("land"), st.integers(0, 1000))
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))
step_op = st.tuples(st.just("step"), st.integers(1, 6))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(add_op, land_op, abort_op, step_op), max_size=40),
       num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(4, 64), max_num_seqs=st.integers(1, 8))
def test_block_accounting_never_leaks_with_kv_pulls(ops, num_blocks, block_size, budget, max_num_seqs):
    mirror = CacheMirror()
    sched = Scheduler(BlockPool(num_blocks, block_size, on_event=mirror), SAMPLER, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=num_blocks * block_size)
    live: list[Sequence] = []
    aborted: set[Sequence] = set()
    for op in ops:
        if op[0] == "add":
            _, pull, prefix_len, suffix_len, max_tokens, n = op
            prompt = (BASE[:prefix_len] + [100 + (prefix_len * 31 + i * 17) % 300 for i in range(suffix_len)])
            prompt = prompt[: sched.max_model_len - 1]
            for i in range(n):
                seq = make_seq(prompt, max_tokens, pull=pull, index=i)
                sched.add(seq)
                live.append(seq)
        elif op[0] == "land" and sched.pulling:
            sched.land(sched.pulling[: 1 + op[1] % len(sched.pulling)])
        elif op[0] == "abort" and live:
            seq = live[op[1] % len(live)]
            sched.abort(seq)
            aborted.add(seq)
        elif op[0] == "step":
            for _ in range(op[1]):
                if sched.has_work():
                    sched.complete(sched.schedule())
        check_consistent(sched, mirror)

    for _ in range(20_000):  # run to idle, every transfer landing one step late
        if not sched.has_work():
            break
        pulling = list(sched.pulling)
        sched.complete(sched.schedule())
        sched.land(pulling)
        check_consistent(sched, mirror)
    assert not sched.has_work(), "the scheduler did not finish its work"
    assert sched.pool.num_in_use == 0
    for seq in live:
        assert seq.status == FINISHED
        if seq not in aborted:
            expected = min(seq.max_tokens, sched.max_model_len - seq.num_prompt_tokens)
            assert seq.num_output_tokens == expected
            # Deterministic tokens: a pulled prompt generates what a local one would.
            assert seq.tokens[seq.num_prompt_tokens:] == [SAMPLER.token(seq.choice, i, None) for i in range(expected)]
            if seq.num_pull_tokens:  # it was pulled: only what it found locally counts as cached
                assert seq.num_cached_tokens == seq.num_prompt_tokens - seq.num_pull_tokens


def test_a_landed_sequence_recomputes_only_its_last_prompt_token():
    mirror = CacheMirror()
    sched = Scheduler(BlockPool(32, 4, on_event=mirror), SAMPLER, max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=128)
    seq = make_seq(list(range(100, 110)), max_tokens=2, pull=True)  # 10 tokens: 2 full blocks + 2
    sched.add(seq)
    step = sched.schedule()
    assert step.pulls == [seq] and not step.scheduled and seq.status == PULLING
    assert len(seq.blocks) == 3 and not mirror.hashes  # held, but not cached before the KV is there
    sched.land([seq])
    assert seq.status == WAITING and seq.num_computed == 9 and mirror.hashes == set(seq.hashes[:2])
    step = sched.schedule()
    assert step.scheduled == [(seq, 1)] and step.prefill_tokens == 1
    sched.complete(step)
    assert seq.num_cached_tokens == 0 and seq.num_output_tokens == 1  # pulled, not a local cache hit
    sched.complete(sched.schedule())
    assert seq.status == FINISHED and sched.pool.num_in_use == 0

    # A prefix the decode worker has cached itself is not pulled again.
    again = make_seq(list(range(100, 108)) + [7, 8, 9], max_tokens=1, pull=True)
    sched.add(again)
    assert sched.schedule().pulls == [again] and again.num_pull_tokens == 11 - 8


# ---------------------------------------------------------------- the worker process

async def test_prefill_workers_publish_kv_events_and_decode_workers_only_load(model_dir):
    workers = []
    try:
        for mode in ("prefill", "decode"):
            cfg = parse_mocker_args(["--disaggregation-mode", mode, "--speedup-ratio", "0"])
            info = cfg.model_info
            sampler = TokenSampler(info.vocab_size, info.eos_token_ids, info.special_token_ids, 0)
            workers.append(SimulatedWorker(cfg, WorkerEngines(cfg, sampler), Health(), WorkerEventPlane("zmq", "127.0.0.1"),
                                           instance_id=f"w{mode}"))
        p, d = workers
        assert (p.card.disaggregation_mode, d.card.disaggregation_mode) == ("prefill", "decode")
        assert (p.card.component, d.card.component) == ("prefill", "backend")
        tasks = [asyncio.create_task(w.engines[0].run()) for w in workers]
        prompt = list(range(1000, 1200))
        [last] = [c async for c in p.handlers.generate(request(prompt, max_tokens=10), None)]
        assert last.kv_transfer_params["remote_engine_id"] == p.instance_id
        out = [c async for c in d.handlers.generate(request(prompt, max_tokens=10, ignore_eos=True,
                                                            kv_transfer_params=last.kv_transfer_params), None)]
        assert len(tokens_of(out)) == 10 and out[-1].usage.cached_tokens == 0  # pulled, not cached locally
        for t in tasks:
            t.cancel()
        [p_kv], [d_kv] = p.events.kv, d.events.kv
        assert p_kv.next_event_id > 0  # routers index the prefill workers' caches
        assert d_kv.next_event_id == 0 and d.engines[0].scheduler.pool.cached  # cached, not announced
        assert d.events.load.published > 0
        # Routers follow the decode worker's address for its load (and skip its KV events).
        assert d.card.kv_events_address == d.card.load_metrics_address == d.events.address
    finally:
        for w in workers:
            w.close()


def test_kv_bytes_per_token_from_the_model_config(model_dir):
    cfg = parse_mocker_args(["--disaggregation-mode", "decode"])
    assert cfg.kv_transfer.bytes_per_token == 23040  # SmolLM2-135M: 2 x 30 layers x 3 heads x 64 x 2 bytes
    assert cfg.kv_transfer.bandwidth_bytes_per_s == 25e9
    # No num_key_value_heads: every head has its own KV; no head_dim: hidden_size / heads.
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_bytes_per_token(config) == 2 * 2 * 4 * 16 * 2
    assert kv_bytes_per_token({}) is None
    cfg = parse_mocker_args(["--kv-bytes-per-token", "1000", "--kv-transfer-bandwidth", "0.5"])
    assert (cfg.kv_transfer.bytes_per_token, cfg.kv_transfer.bandwidth_bytes_per_s) == (1000, 5e8)


def test_bad_kv_transfer_flags_name_the_flag(model_dir, capsys):
    for argv, flag in ((["--kv-transfer-bandwidth", "0"], "--kv-transfer-bandwidth"),
                       (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token")):
        with pytest.raises(SystemExit) as info:
            parse_mocker_args(argv)
        assert info.value.code == 2 and flag in capsys.readouterr().err


async def test_the_mocker_refuses_structured_outputs_naming_the_field():
    async with worker("agg") as w:
        req = request(max_tokens=5)
        req.structured_outputs = StructuredOutputs(regex="a+")
        with pytest.raises(InvalidRequest, match="structured_outputs") as info:
            await chunks(w, req)
        assert info.value.error.param == "structured_outputs"

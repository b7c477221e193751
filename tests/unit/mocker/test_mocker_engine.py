"""A simulated worker's generate handler on its engine: deterministic tokens, stop
conditions, usage, cancellation, input checks, timing profiles and speedup."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import REGISTRY

from turbine.mocker.engine import MockEngine, Outputs
from turbine.mocker.handlers import AggregatedHandlers, Handlers
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.scheduler import Scheduler, SeqOutput
from turbine.mocker.timing import TimingProfile, load_profile
from turbine.mocker.tokens import TokenSampler
from turbine.protocol.generate import (
    ClearKvBlocksRequest,
    GenerateRequest,
    ImageInput,
    OutputOptions,
    SamplingOptions,
    StopConditions,
)
from turbine.runtime.errors import AdapterNotLoaded, InvalidRequest
from turbine.worker.worker_metrics import WorkerMetrics

EOS = 2
PROMPT = list(range(100, 140))


@contextlib.asynccontextmanager
async def worker(*, speedup: float = 0.0, natural_output_len: int = 0, timing: TimingProfile | None = None,
                 on_success=None):
    sampler = TokenSampler(1000, eos_token_ids=[EOS], special_token_ids=[0, 1, 2],
                           natural_output_len=natural_output_len)
    scheduler = Scheduler(BlockPool(256, 16), sampler, max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=4096)
    engine = MockEngine(scheduler, timing or TimingProfile(), speedup)
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": str(id(engine))})
    task = asyncio.create_task(engine.run())
    try:
        yield AggregatedHandlers([engine], metrics, vocab_size=1000, on_success=on_success)
    finally:
        task.cancel()


def request(prompt=PROMPT, n=1, **stop) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=list(prompt), sampling=SamplingOptions(n=n),
                           stop=StopConditions(**stop))


async def collect(handlers: Handlers, req: GenerateRequest):
    """Per choice: (token ids, finish_reason, stop_reason, usage)."""
    out: dict[int, list] = {}
    async for chunk in handlers.generate(req, None):
        entry = out.setdefault(chunk.index, [[], None, None, None])
        entry[0] += chunk.token_ids
        if chunk.finish_reason is not None:
            entry[1:] = [chunk.finish_reason, chunk.stop_reason, chunk.usage]
    return [out[i] for i in sorted(out)]


async def test_outputs_are_deterministic_per_request_and_choice():
    async with worker() as h:
        first = await collect(h, request(n=3, max_tokens=12, ignore_eos=True))
        again = await collect(h, request(n=3, max_tokens=12, ignore_eos=True))
        other = await collect(h, request(prompt=PROMPT[:-1] + [7], max_tokens=12, ignore_eos=True))
    tokens = [c[0] for c in first]
    assert tokens == [c[0] for c in again]
    assert len({tuple(t) for t in tokens}) == 3  # each choice differs
    assert other[0][0] != tokens[0]
    for toks, finish, _, usage in first:
        assert len(toks) == 12 and finish == "length" and usage.completion_tokens == 12
        assert not {0, 1, 2} & set(toks)  # neither special tokens nor EOS


async def test_stop_token_ids_end_the_answer_but_not_before_min_tokens():
    async with worker() as h:
        [(tokens, *_)] = await collect(h, request(max_tokens=30, ignore_eos=True))
        stop_id = tokens[4]
        [(stopped, finish, reason, usage)] = await collect(
            h, request(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))
        [(masked, *_)] = await collect(
            h, request(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=10))
    first = tokens.index(stop_id)
    assert stopped == tokens[:first + 1] and (finish, reason) == ("stop", stop_id)
    assert usage.completion_tokens == first + 1
    assert stop_id not in masked[:10] and masked[10:] == tokens[10:len(masked)]


async def test_answers_end_with_eos_unless_ignore_eos():
    async with worker(natural_output_len=10) as h:
        [(tokens, finish, reason, _)] = await collect(h, request(max_tokens=100))
        [(longer, *_)] = await collect(h, request(max_tokens=100, min_tokens=40))
        [(ignored, ignored_finish, *_)] = await collect(h, request(max_tokens=100, ignore_eos=True))
    assert tokens[-1] == EOS and EOS not in tokens[:-1]
    assert (finish, reason) == ("stop", None) and 5 <= len(tokens) <= 15
    assert len(longer) == 40 and longer[-1] == EOS  # EOS is masked until min_tokens
    assert len(ignored) == 100 and ignored_finish == "length" and EOS not in ignored


async def test_logprobs_are_well_formed_when_asked_for():
    async with worker() as h:
        req = request(max_tokens=5, ignore_eos=True)
        req.output = OutputOptions(logprobs=3)
        chunks = [c async for c in h.generate(req, None)]
    for c in chunks:
        assert len(c.log_probs) == len(c.top_logprobs) == len(c.token_ids)
        for token, logprob, top in zip(c.token_ids, c.log_probs, c.top_logprobs):
            assert len(top) == 3 and (top[0].token_id, top[0].logprob) == (token, logprob) and logprob <= 0
    assert sum(len(c.token_ids) for c in chunks) == 5


async def test_usage_counts_prefix_cache_hits():
    async with worker() as h:
        [(*_, cold)] = await collect(h, request(max_tokens=2))
        [(*_, warm)] = await collect(h, request(prompt=PROMPT[:35] + [999] * 5, max_tokens=2))
    assert (cold.prompt_tokens, cold.completion_tokens, cold.cached_tokens) == (40, 2, 0)
    assert warm.cached_tokens == 32  # two full blocks of 16 shared


async def test_cancelling_a_stream_frees_its_blocks_at_once():
    async with worker(speedup=1.0) as h:
        pool = h.engines[0].scheduler.pool
        stream = h.generate(request(max_tokens=1000, ignore_eos=True), None)
        await anext(stream)
        await anext(stream)
        assert pool.num_in_use > 0
        await stream.aclose()
        assert pool.num_in_use == 0
        assert not h.engines[0].scheduler.has_work()
        labels = {"namespace": "t", "component": "c", "model": "m", "worker_id": str(id(h.engines[0]))}
        assert REGISTRY.get_sample_value("turbine_worker_cancellations_total", labels) == 1


async def test_completed_requests_and_only_those_are_reported_as_successes():
    done = []
    async with worker(on_success=lambda: done.append(1)) as h:
        await collect(h, request(max_tokens=3, ignore_eos=True))
        assert len(done) == 1  # the health checks skip the canary after this
        with pytest.raises(InvalidRequest):
            await collect(h, request(prompt=[]))  # invalid: not a success
        stream = h.generate(request(max_tokens=50, ignore_eos=True), None)
        await anext(stream)
        await stream.aclose()  # cancelled: not a success
        assert len(done) == 1


async def test_outputs_that_pile_up_are_taken_together_in_order():
    outputs = Outputs()
    outs = [SeqOutput(seq=None, token=t) for t in range(3)]
    outputs.put(outs[0])
    outputs.put(outs[1])
    assert await outputs.take() == outs[:2]
    reader = asyncio.create_task(outputs.take())
    await asyncio.sleep(0)
    assert not reader.done()  # nothing left: it waits
    outputs.put(outs[2])
    assert await reader == outs[2:]


async def test_invalid_requests_raise_a_typed_error():
    async with worker() as h:
        for req, words in ((request(prompt=[]), "empty"), (request(prompt=[5] * 4096), "context length"),
                           (request(prompt=[5, 1000]), "vocabulary"),
                           (request(max_tokens=2, min_tokens=3), "min_tokens"),
                           (GenerateRequest(request_id="r", model="m", token_ids=[], prompt_embeds=b"PK"),
                            "prompt_embeds: the mocker does not take prompt embeddings"),
                           (GenerateRequest(request_id="r", model="m", token_ids=[5],
                                            images=[ImageInput(data=b"\x89PNG", hash="0" * 64)]),
                            "images: the mocker takes no images"),
                           (GenerateRequest(request_id="r", model="m", token_ids=[5],
                                            sampling=SamplingOptions(logit_bias={5: 1.0})), "logit_bias"),
                           (GenerateRequest(request_id="r", model="m", token_ids=[5],
                                            output=OutputOptions(logprobs=1000)), "logprobs")):
            with pytest.raises(InvalidRequest, match=words) as info:
                await collect(h, req)
            assert info.value.error.code == "invalid_request" and not info.value.error.retryable
        # An adapter this worker does not hold: another worker may (the frontend tries it), not the client's 400.
        with pytest.raises(AdapterNotLoaded, match="no such LoRA adapter is loaded on this worker") as info:
            await collect(h, GenerateRequest(request_id="r", model="m", token_ids=[5], lora_name="sql"))
        assert info.value.error.code == "adapter_not_loaded" and info.value.error.retryable
        assert info.value.error.param == "lora_name"


async def test_clear_kv_blocks_empties_the_prefix_cache():
    async with worker() as h:
        await collect(h, request(max_tokens=2))
        assert h.engines[0].scheduler.pool.cached
        [reply] = [r async for r in h.clear_kv_blocks(ClearKvBlocksRequest(), None)]
        assert reply.status == "success" and not h.engines[0].scheduler.pool.cached


async def test_speedup_ratio_scales_simulated_step_time():
    slow = TimingProfile(step_base_ms=100.0, prefill_ms_per_token=0, decode_ms_per_seq=0, decode_ms_per_kv_token=0)
    async with worker(speedup=4.0, timing=slow) as h:
        started = time.monotonic()
        await collect(h, request(max_tokens=4, ignore_eos=True))
        # 4 steps of 100 ms at 4x: at least 100 ms (a lower bound: the machine may be slower).
        assert time.monotonic() - started >= 0.095


def test_timing_profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"step_base_ms": 5, "prefill_ms_per_token": 0.5, "source": "test"}')
    profile = load_profile(path)
    assert profile.step_ms(prefill_tokens=10, prefill_pairs=0, decode_seqs=0, decode_kv_tokens=0) == 10.0
    assert profile.decode_ms_per_seq == TimingProfile().decode_ms_per_seq  # unset: the default
    assert profile.step_ms(0, 0, 0, 0) == 0.0
    for bad, words in (('{"step_base_ms": 5, "typo_ms": 1}', "typo_ms"), ('{"step_base_ms": -1}', ">= 0"),
                       ('{"step_base_ms": "fast"}', "step_base_ms")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=words):
            load_profile(path)

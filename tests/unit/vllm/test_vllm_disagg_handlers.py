"""The vLLM worker's disaggregation roles, on an engine stand-in that records what it is
asked (the real engine path is covered by tests/integration/test_disagg_vllm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from turbine.protocol.generate import GenerateRequest, SamplingOptions, StopConditions
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.worker.worker_metrics import WorkerMetrics
from turbine.vllm.handlers import HANDLERS_OF_ROLE, Handlers, checked_kv_transfer_params, sampling_kwargs, sampling_params

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
          "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "10.0.0.2", "remote_port": 20001,
          "tp_size": 1, "remote_blocks_expiry_time": None}


class Engine:
    """Answers like AsyncLLM.generate; a request carrying KV transfer parameters never gets
    its KV (the prefill worker hung), so it never produces output."""

    def __init__(self):
        model_config = SimpleNamespace(max_model_len=512, get_diff_sampling_param=lambda: {})
        self.vllm_config = SimpleNamespace(model_config=model_config)
        self.calls: list[tuple[str, bool]] = []
        self.aborted: list[str] = []
        self.ranks: list[int | None] = []

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.calls.append((request_id, bool(params.extra_args)))
        self.ranks.append(data_parallel_rank)
        if params.extra_args:
            await asyncio.Event().wait()
        comp = SimpleNamespace(index=0, token_ids=[7, 8], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def handlers(role: str, timeout: float = 0.2, data_parallel_size: int = 1) -> tuple[Handlers, Engine]:
    engine = Engine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": f"w-{role}"})
    return HANDLERS_OF_ROLE[role](engine, metrics, kv_transfer_timeout=timeout,
                                  data_parallel_size=data_parallel_size), engine


async def test_decode_gives_up_on_kv_that_never_arrives_and_prefills_locally():
    h, engine = handlers("decode")
    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], kv_transfer_params=PARAMS)
    async def collect():
        return [o async for o in h.generate(req, None)]

    outs = await asyncio.wait_for(collect(), 10)  # without the timeout this waits forever
    assert [o.token_ids for o in outs] == [[7, 8]] and outs[-1].finish_reason == "length"
    (first_id, pulled), (second_id, local) = engine.calls
    assert pulled and not local  # the retry carries no transfer parameters: computed here
    assert engine.aborted[0] == first_id  # the stuck attempt was aborted in the engine


def test_prefill_role_asks_the_connector_to_keep_the_kv_for_decode():
    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=50))
    params = handlers("prefill")[0].sampling_params(req)
    assert params.max_tokens == 1
    assert params.extra_args["kv_transfer_params"]["do_remote_decode"] is True
    agg = sampling_params(sampling_kwargs(req, {}, 512))
    assert agg.max_tokens == 50 and not agg.extra_args
    with pytest.raises(InvalidRequest, match="n must be 1"):
        handlers("prefill")[0].sampling_params(GenerateRequest(request_id="x", model="m", token_ids=[1],
                                                               sampling=SamplingOptions(n=2)))


def test_decode_role_passes_checked_params_and_agg_ignores_them():
    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], kv_transfer_params=PARAMS)
    assert handlers("decode")[0].sampling_params(req).extra_args["kv_transfer_params"] == PARAMS
    assert not handlers("agg")[0].sampling_params(req).extra_args


@pytest.mark.parametrize("bad", [
    {**PARAMS, "do_remote_prefill": False},
    {**PARAMS, "remote_port": "20001"},
    {**PARAMS, "remote_port": 70000},
    {**PARAMS, "remote_host": None},
    {**PARAMS, "remote_block_ids": [[1, -2]]},
    {**PARAMS, "remote_block_ids": "1,2"},
    {**PARAMS, "extra": {"nested": "dict"}},
])
def test_malformed_kv_transfer_params_are_refused(bad):
    with pytest.raises(InvalidRequest, match="kv_transfer_params"):
        checked_kv_transfer_params(bad)


async def test_typed_errors_lora_dp_rank_and_aborts_we_did_not_cause():
    h, engine = handlers("agg", data_parallel_size=2)
    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], dp_rank=1)
    assert [o.token_ids for o in [o async for o in h.generate(req, None)]] == [[7, 8]]
    assert engine.ranks == [1]  # the router's rank reaches the engine
    for bad, words in ((GenerateRequest(request_id="x", model="m", token_ids=[1], dp_rank=2), "dp_rank 2"),
                       (GenerateRequest(request_id="x", model="m", token_ids=[1], lora_name="sql"),
                        "takes no LoRA adapters"),
                       (GenerateRequest(request_id="x", model="m", token_ids=[]), "token_ids is empty")):
        with pytest.raises(InvalidRequest, match=words) as info:
            [o async for o in h.generate(bad, None)]
        assert info.value.error.code == "invalid_request"

    async def aborted(prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        comp = SimpleNamespace(index=0, token_ids=[], logprobs=None, finish_reason="abort", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def dead(prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        from vllm.v1.engine.exceptions import EngineDeadError
        raise EngineDeadError()
        yield

    for generate, code in ((aborted, "cancelled"), (dead, "engine_failure")):
        engine.generate = generate
        with pytest.raises(RequestFailed) as info:
            [o async for o in h.generate(GenerateRequest(request_id="x", model="m", token_ids=[1]), None)]
        assert info.value.error.code == code and info.value.error.retryable

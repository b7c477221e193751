"""The vLLM worker's disaggregation roles, on an engine stand-in that records what it is
asked (the real engine path is covered by tests/integration/test_disagg_vllm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from turbine.protocol.generate import GenerateRequest, SamplingOptions, StopConditions
from turbine.runtime.worker_metrics import WorkerMetrics
from turbine.vllm.handlers import Handlers, InvalidRequest, build_sampling_params, checked_kv_transfer_params

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

    async def generate(self, prompt, params, request_id):
        self.calls.append((request_id, bool(params.extra_args)))
        if params.extra_args:
            await asyncio.Event().wait()
        comp = SimpleNamespace(index=0, token_ids=[7, 8], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def handlers(role: str, timeout: float = 0.2) -> tuple[Handlers, Engine]:
    engine = Engine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": f"w-{role}"})
    return Handlers(engine, metrics, role=role, kv_transfer_timeout=timeout), engine


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
    params = build_sampling_params(req, {}, 512, role="prefill")
    assert params.max_tokens == 1
    assert params.extra_args["kv_transfer_params"]["do_remote_decode"] is True
    agg = build_sampling_params(req, {}, 512)
    assert agg.max_tokens == 50 and not agg.extra_args
    with pytest.raises(InvalidRequest, match="n must be 1"):
        build_sampling_params(GenerateRequest(request_id="x", model="m", token_ids=[1],
                                              sampling=SamplingOptions(n=2)), {}, 512, role="prefill")


def test_decode_role_passes_checked_params_and_agg_ignores_them():
    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], kv_transfer_params=PARAMS)
    assert build_sampling_params(req, {}, 512, role="decode").extra_args["kv_transfer_params"] == PARAMS
    assert not build_sampling_params(req, {}, 512, role="agg").extra_args


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

"""Overload control on a worker (turbine/worker/admission.py): the queue it counts, the bounds,
the vLLM handler refusing before the engine sees the request, and the flags that set it all."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from turbine.frontend.args import parse_frontend_args
from turbine.mocker.args import parse_mocker_args
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateRequest, StopConditions
from turbine.runtime.errors import RequestFailed
from turbine.vllm.args import parse_worker_args
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.worker.admission import Admission
from turbine.worker.config import DEFAULT_MAX_QUEUED_PREFILL_TOKENS, DEFAULT_MAX_WAITING_REQUESTS
from turbine.worker.worker_metrics import WorkerMetrics


def metrics(name: str) -> WorkerMetrics:
    return WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": name})


def test_the_waiting_bound_refuses_until_a_request_starts():
    adm = Admission(max_waiting_requests=2, max_queued_prefill_tokens=None)
    first, second = adm.admit(10), adm.admit(10)
    with pytest.raises(RequestFailed) as info:
        adm.admit(10)
    assert info.value.error.code == codes.OVERLOADED and info.value.error.retryable
    assert "--max-waiting-requests 2" in str(info.value)
    first.started()  # its first output: it no longer waits
    first.release()  # (ending afterwards changes nothing more)
    assert (adm.waiting, adm.queued_prefill_tokens) == (1, 10)
    adm.admit(5).release()
    second.release()
    assert (adm.waiting, adm.queued_prefill_tokens) == (0, 0)


def test_the_token_bound_takes_one_prompt_larger_than_itself_when_nothing_waits():
    adm = Admission(max_waiting_requests=None, max_queued_prefill_tokens=100)
    big = adm.admit(500)  # alone: it could never run otherwise
    with pytest.raises(RequestFailed, match="--max-queued-prefill-tokens 100"):
        adm.admit(1)
    big.started()
    small = adm.admit(60)
    with pytest.raises(RequestFailed):
        adm.admit(41)
    adm.admit(40).release()
    small.release()
    assert (adm.waiting, adm.queued_prefill_tokens) == (0, 0)


class Engine:
    """Answers like AsyncLLM.generate once `go` is set; records every request it is given."""

    def __init__(self):
        model_config = SimpleNamespace(max_model_len=512, get_diff_sampling_param=lambda: {})
        self.vllm_config = SimpleNamespace(model_config=model_config)
        self.calls: list[str] = []
        self.go = asyncio.Event()

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.calls.append(request_id)
        await self.go.wait()
        comp = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id):
        pass


async def test_the_vllm_handler_refuses_before_the_engine_sees_the_request():
    engine, m = Engine(), metrics("vllm-admission")
    h = HANDLERS_OF_ROLE["agg"](engine, m, admission=Admission(1, None, m))

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(request_id=rid, model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=1))

    async def answer(rid: str):
        return [o async for o in h.generate(request(rid), None)]

    first = asyncio.create_task(answer("a"))
    while not engine.calls:
        await asyncio.sleep(0.01)
    assert m.waiting_requests._value.get() == 1 and m.queued_prefill_tokens._value.get() == 3
    with pytest.raises(RequestFailed) as info:
        await answer("b")
    assert info.value.error.code == codes.OVERLOADED
    assert len(engine.calls) == 1  # the refused request never reached the engine
    engine.go.set()
    assert (await first)[-1].finish_reason == "length"
    assert (await answer("c"))[-1].finish_reason == "length"  # the queue emptied: admitted again
    assert m.waiting_requests._value.get() == 0


def test_the_bounds_have_defaults_and_reach_the_configs():
    cfg = parse_mocker_args([])
    assert (cfg.max_waiting_requests, cfg.max_queued_prefill_tokens) == (
        DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_MAX_QUEUED_PREFILL_TOKENS)
    cfg = parse_worker_args(["--max-waiting-requests", "8", "--max-queued-prefill-tokens", "0"])
    adm = cfg.admission()
    assert (adm.max_waiting_requests, adm.max_queued_prefill_tokens) == (8, None)  # 0: no bound
    front = parse_frontend_args(["--max-inflight-requests", "3", "--overload-retry-after", "5"])
    assert (front.max_inflight_requests, front.overload_retry_after) == (3, 5)


@pytest.mark.parametrize("parse,argv,flag", [
    (parse_mocker_args, ["--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (parse_mocker_args, ["--max-queued-prefill-tokens", "-5"], "--max-queued-prefill-tokens"),
    (parse_worker_args, ["--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (parse_worker_args, ["--max-queued-prefill-tokens", "many"], "--max-queued-prefill-tokens"),
    (parse_frontend_args, ["--max-inflight-requests", "0"], "--max-inflight-requests"),
    (parse_frontend_args, ["--overload-retry-after", "-1"], "--overload-retry-after"),
])
def test_bad_overload_flags_name_the_flag(parse, argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err

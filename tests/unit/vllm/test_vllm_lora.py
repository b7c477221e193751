"""The vLLM worker's adapters (turbine/vllm/lora.py) with its handlers, on an engine stand-in
that records what it is asked (the real engine: tests/integration/test_lora_vllm.py): a request
naming an adapter reaches the engine with its LoRARequest; an unload refuses new requests at once
and removes the adapter from the engine only once the requests using it have ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from turbine.protocol.generate import GenerateRequest
from turbine.runtime.errors import AdapterNotLoaded, InvalidRequest
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.vllm.lora import VllmLora
from turbine.worker.worker_metrics import WorkerMetrics


class Engine:
    def __init__(self, lora: bool = True):
        model_config = SimpleNamespace(max_model_len=512, get_diff_sampling_param=lambda: {})
        self.vllm_config = SimpleNamespace(model_config=model_config,
                                           lora_config=SimpleNamespace(max_lora_rank=8) if lora else None)
        self.gate = asyncio.Event()
        self.seen: list[object] = []  # each generate's lora_request
        self.added: list[int] = []
        self.removed: list[int] = []

    async def add_lora(self, request) -> bool:
        self.added.append(request.lora_int_id)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.seen.append(lora_request)
        await self.gate.wait()
        comp = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id):
        pass


def handlers(engine: Engine):
    loras = VllmLora(engine, "/nonexistent", "m")
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": "lora"})
    return HANDLERS_OF_ROLE["agg"](engine, metrics, loras=loras), loras


def request(lora_name: str | None) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[1, 2, 3], lora_name=lora_name)


async def test_unload_waits_for_the_requests_using_the_adapter():
    engine = Engine()
    h, loras = handlers(engine)
    assert loras.lora_refusal() is None and loras.max_lora_rank == 8 and loras.base_model_dir is None
    await loras.add("sql", 5, "/adapters/sql")
    async def whole(req):
        return [o async for o in h.generate(req, None)]

    running = asyncio.create_task(whole(request("sql")))
    while not engine.seen:
        await asyncio.sleep(0.01)
    assert (engine.seen[0].lora_name, engine.seen[0].lora_int_id, engine.seen[0].lora_path) == ("sql", 5,
                                                                                               "/adapters/sql")
    unload = asyncio.create_task(loras.remove("sql", 5))
    await asyncio.sleep(0.3)
    assert not unload.done() and engine.removed == []  # the running request still uses it
    with pytest.raises(AdapterNotLoaded, match="no such LoRA adapter"):  # but no new one may
        await whole(request("sql"))
    engine.gate.set()
    assert [o.token_ids for o in await running] == [[7]]
    await asyncio.wait_for(unload, 5)
    assert engine.removed == [5] and loras.in_use == {}
    # the base model is served as ever
    assert [o.token_ids for o in await whole(request(None))] == [[7]] and engine.seen[-1] is None


async def test_without_enable_lora_adapters_are_refused():
    h, loras = handlers(Engine(lora=False))
    assert "--enable-lora" in loras.lora_refusal()
    with pytest.raises(InvalidRequest, match="--enable-lora"):
        await anext(h.generate(request("sql"), None))

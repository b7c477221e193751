"""The vLLM worker's prompt-embeddings loader and handler path, on an engine stand-in (the real
engine: tests/integration/test_prompt_embeds.py)."""

from __future__ import annotations

import io
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from turbine.protocol.generate import GenerateRequest, StopConditions
from turbine.runtime.errors import InvalidRequest
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.vllm.prompt_embeds import load_prompt_embeds
from turbine.worker.worker_metrics import WorkerMetrics

HIDDEN = 8


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(payload: bytes) -> torch.Tensor:
    return load_prompt_embeds(payload, hidden_size=HIDDEN, dtype=torch.float32, max_model_len=64)


def test_a_2d_float_tensor_is_loaded_and_cast_to_the_model_dtype():
    t = torch.randn(5, HIDDEN, dtype=torch.float16)
    out = load(saved(t))
    assert out.dtype == torch.float32 and torch.equal(out, t.float())
    # A sparse tensor is checked and made dense.
    sparse = torch.zeros(3, HIDDEN)
    sparse[1, 2] = 1.0
    assert torch.equal(load(saved(sparse.to_sparse())), sparse)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("payload,words", [
    (saved(torch.zeros(HIDDEN)), "2-D"),
    (saved(torch.zeros(1, 3, HIDDEN)), "2-D"),
    (saved(torch.zeros(3, HIDDEN + 1)), "hidden size 9"),
    (saved(torch.zeros(3, HIDDEN, dtype=torch.int64)), "floating-point"),
    (saved(torch.zeros(3, HIDDEN, dtype=torch.bool)), "floating-point"),
    (saved(torch.zeros(0, HIDDEN)), "empty"),
    (saved(torch.zeros(64, HIDDEN)), "context length is 64"),
    (saved({"t": torch.zeros(3, HIDDEN)}), "did not deserialize to a torch.Tensor"),
    (pickle.dumps(Evil()), "could not be loaded"),  # weights-only: never runs the pickle's code
    (b"garbage", "could not be loaded"),
    (b"", "could not be loaded"),
], ids=["1-D", "3-D", "hidden size", "int", "bool", "empty", "over context", "dict", "evil pickle", "garbage",
        "no bytes"])
def test_bad_payloads_are_invalid_requests_naming_prompt_embeds(payload, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        load(payload)
    assert str(info.value).startswith("prompt_embeds: ")


class Engine:
    def __init__(self, enable: bool):
        model_config = SimpleNamespace(max_model_len=64, get_diff_sampling_param=lambda: {},
                                       enable_prompt_embeds=enable, get_hidden_size=lambda: HIDDEN,
                                       dtype=torch.float32)
        self.vllm_config = SimpleNamespace(model_config=model_config)
        self.prompts = []

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.prompts.append((prompt, params.max_tokens))
        comp = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id):
        pass


def handlers(role: str, enable: bool = True):
    engine = Engine(enable)
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": f"pe-{role}-{enable}"})
    return HANDLERS_OF_ROLE[role](engine, metrics), engine


def request(**fields) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[], prompt_embeds=saved(torch.ones(5, HIDDEN)),
                           **fields)


async def test_the_engine_gets_the_tensor_and_usage_counts_its_rows():
    h, engine = handlers("agg")
    [out] = [o async for o in h.generate(request(), None)]
    prompt, max_tokens = engine.prompts[0]
    assert torch.equal(prompt["prompt_embeds"], torch.ones(5, HIDDEN)) and "prompt_token_ids" not in prompt
    assert max_tokens == 64 - 5  # what the context leaves
    assert out.usage.prompt_tokens == 5


@pytest.mark.parametrize("role,enable,req,words", [
    ("agg", False, request(), "--enable-prompt-embeds"),
    ("prefill", True, request(), "prefill worker"),
    ("agg", True, request(stop=StopConditions(max_tokens=60)), "max_tokens"),
    ("agg", True, GenerateRequest(request_id="r", model="m", token_ids=[1], prompt_embeds=saved(torch.ones(2, HIDDEN))),
     "not both"),
])
async def test_requests_the_worker_cannot_take(role, enable, req, words):
    h, engine = handlers(role, enable)
    with pytest.raises(InvalidRequest, match=words) as info:
        [o async for o in h.generate(req, None)]
    assert "prompt_embeds" in str(info.value) or "max_tokens" in str(info.value)
    assert not engine.prompts

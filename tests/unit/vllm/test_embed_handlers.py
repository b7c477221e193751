"""The pooling worker's `embed` endpoint on an engine stand-in that answers like AsyncLLM.encode
(the real engine: tests/integration/test_embeddings.py)."""

from __future__ import annotations

import array
from types import SimpleNamespace

import pytest
import torch

from turbine.protocol.embed import EmbedRequest
from turbine.runtime.errors import InvalidRequest
from turbine.vllm.embed import EmbedHandlers
from turbine.worker.worker_metrics import WorkerMetrics


class Engine:
    def __init__(self):
        model_config = SimpleNamespace(max_model_len=16, get_vocab_size=lambda: 100)
        self.vllm_config = SimpleNamespace(model_config=model_config)
        self.asked, self.aborted = [], []

    async def encode(self, prompt, params, request_id):
        self.asked.append((prompt["prompt_token_ids"], params.task))
        ids = prompt["prompt_token_ids"]
        data = torch.tensor([float(len(ids)), float(ids[0])], dtype=torch.bfloat16)
        yield SimpleNamespace(outputs=SimpleNamespace(data=data), finished=True)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def handlers():
    engine = Engine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": "embed-unit"})
    return EmbedHandlers(engine, metrics), engine


async def test_each_input_is_pooled_and_returned_as_float32_bytes_in_order():
    h, engine = handlers()
    [out] = [o async for o in h.embed(EmbedRequest(request_id="r", model="m", inputs=[[5, 6, 7], [9]]), None)]
    assert [array.array("f", v).tolist() for v in out.embeddings] == [[3.0, 5.0], [1.0, 9.0]]
    assert out.prompt_tokens == 4 and sorted(engine.asked) == [([5, 6, 7], "embed"), ([9], "embed")]
    assert not engine.aborted


@pytest.mark.parametrize("inputs,words", [([], "at least one token"), ([[1], []], "at least one token"),
                                          ([[1] * 17], "context length"), ([[100]], "vocabulary")])
async def test_bad_inputs_are_invalid_requests(inputs, words):
    h, engine = handlers()
    with pytest.raises(InvalidRequest, match=words):
        [o async for o in h.embed(EmbedRequest(request_id="r", model="m", inputs=inputs), None)]
    assert not engine.asked

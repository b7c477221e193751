"""The vLLM worker's answers about structured outputs, on an engine stand-in (the real engine's
refusals are covered end to end by tests/integration/test_structured_outputs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError

from tests.unit.vllm.test_vllm_disagg_handlers import Engine, handlers
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateRequest, StructuredOutputs
from turbine.runtime.errors import InvalidRequest, RequestFailed

SO = StructuredOutputs(json='{"type": "object"}')


def request(**kw) -> GenerateRequest:
    return GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], **kw)


async def collect(h, req):
    return [o async for o in h.generate(req, None)]


def test_the_constraint_reaches_the_engines_sampling_params():
    params = handlers("agg")[0].sampling_params(request(structured_outputs=StructuredOutputs(choice=["a", "b"])))
    assert params.structured_outputs.choice == ["a", "b"]


def test_options_the_backends_ignore_per_request_are_refused():
    with pytest.raises(InvalidRequest, match="disable_any_whitespace") as info:
        handlers("agg")[0].sampling_params(request(structured_outputs=StructuredOutputs(
            regex="a", disable_any_whitespace=True)))
    assert info.value.error.param == "structured_outputs"


class Refusing(Engine):
    """Raises as AsyncLLM.generate does when its input processor refuses the constraint."""

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        raise VLLMValidationError("Grammar error: Unimplemented keys: [\"uniqueItems\"]")
        yield


class FailsTheRequest(Engine):
    """Finishes the request with vLLM's request-level error (a grammar that failed to compile)."""

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        comp = SimpleNamespace(index=0, token_ids=[], logprobs=None, finish_reason="error", stop_reason=None)
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None)


async def test_a_constraint_the_backend_refuses_is_invalid_request_naming_the_field():
    h, _ = handlers("agg")
    h.engine = Refusing()
    with pytest.raises(InvalidRequest, match="uniqueItems") as info:
        await collect(h, request(structured_outputs=SO))
    assert info.value.error.code == codes.INVALID_REQUEST and info.value.error.param == "structured_outputs"


async def test_a_request_the_engine_fails_is_an_engine_failure_not_an_answer():
    h, _ = handlers("agg")
    h.engine = FailsTheRequest()
    with pytest.raises(RequestFailed) as info:
        await collect(h, request(structured_outputs=SO))
    assert info.value.error.code == codes.ENGINE_FAILURE

"""The frontend's side of prompt embeddings: checks without torch, the bytes on the wire, the
prompt length taken from the worker, no remote prefill. The loading and the tensor checks are
the worker's (tests/unit/vllm/test_prompt_embeds_loader.py, tests/integration/test_prompt_embeds.py)."""

from __future__ import annotations

import base64

import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.config import ConfigError
from turbine.frontend.app import FrontendConfig
from turbine.frontend.deltas import OutputSpec
from turbine.frontend.dispatch.disagg import may_prefill_remotely
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable
from turbine.frontend.postprocess.stage import Postprocess
from turbine.frontend.preprocess.stage import preprocess
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage

PAYLOAD = b"PK\x03\x04 a torch.save file's bytes"


def table(tokenizer, accepts: bool = True) -> ModelTable:
    models = ModelTable(registry=None, make_router=None)
    model = served(tokenizer, [instance("w", "127.0.0.1:1")])  # context length 2048
    model.card.accepts_prompt_embeds = accepts
    models.models["m"] = model
    return models


def body(**fields) -> bytes:
    return msgspec.json.encode({"model": "m", **fields})


async def test_the_payload_goes_to_the_worker_as_bytes_with_no_token_ids(tokenizer):
    p = await preprocess(body(prompt="", prompt_embeds=base64.b64encode(PAYLOAD).decode(), max_tokens=5),
                         "completions", table(tokenizer))
    assert p.request.prompt_embeds == PAYLOAD and p.request.token_ids == []
    assert p.request.stop.max_tokens == 5
    # Without max_tokens the worker fills in what the context leaves (only it knows the length).
    p = await preprocess(body(prompt_embeds=base64.b64encode(PAYLOAD).decode()), "completions", table(tokenizer))
    assert p.request.stop.max_tokens is None
    # msgpack carries the bytes raw.
    wire = msgspec.msgpack.encode(p.request)
    assert PAYLOAD in wire and msgspec.msgpack.decode(wire, type=GenerateRequest).prompt_embeds == PAYLOAD


@pytest.mark.parametrize("fields,param,words", [
    (dict(prompt_embeds="not base64!!"), "prompt_embeds", "base64"),
    (dict(prompt_embeds=""), "prompt_embeds", "empty"),
    (dict(prompt_embeds=7), "prompt_embeds", "base64 string"),
    (dict(prompt_embeds=[base64.b64encode(PAYLOAD).decode()]), "prompt_embeds", "list"),
    (dict(prompt_embeds=base64.b64encode(b"x" * 2000).decode()), "prompt_embeds", "--max-prompt-embeds-bytes"),
    (dict(prompt="hi", prompt_embeds=base64.b64encode(PAYLOAD).decode()), "prompt", "not both"),
    (dict(prompt_embeds=base64.b64encode(PAYLOAD).decode(), max_tokens=2048), "max_tokens", "context length"),
    (dict(), "prompt", "required"),
])
async def test_bad_prompt_embeds_requests_get_a_named_400(tokenizer, fields, param, words):
    with pytest.raises(RequestError) as info:
        await preprocess(body(**fields), "completions", table(tokenizer), max_prompt_embeds_bytes=1000)
    assert (info.value.status, info.value.param) == (400, param) and words in info.value.message


async def test_models_whose_workers_lack_the_flag_and_chat_refuse_them(tokenizer):
    embeds = base64.b64encode(PAYLOAD).decode()
    with pytest.raises(RequestError, match="--enable-prompt-embeds") as info:
        await preprocess(body(prompt="", prompt_embeds=embeds), "completions", table(tokenizer, accepts=False))
    assert info.value.param == "prompt_embeds"
    with pytest.raises(RequestError, match="/v1/completions") as info:
        await preprocess(body(messages=[{"role": "user", "content": "hi"}], prompt_embeds=embeds), "chat",
                         table(tokenizer))
    assert info.value.param == "prompt_embeds"


def test_the_prompt_length_comes_from_the_worker_when_there_are_no_prompt_ids(tokenizer):
    spec = OutputSpec(stop=[], include_stop_str_in_output=False, skip_special_tokens=True)
    post = Postprocess(tokenizer, [], 1, spec)
    post.apply(GenerateOutput(token_ids=tokenizer.encode(" Paris", add_special_tokens=False)))
    delta = post.apply(GenerateOutput(token_ids=[], finish_reason="length",
                                      usage=Usage(prompt_tokens=6, completion_tokens=1)))
    assert delta.finish_reason == "length" and post.usage.prompt_tokens == 6
    # With prompt ids the frontend's own count stands.
    post = Postprocess(tokenizer, [1, 2], 1, spec)
    post.apply(GenerateOutput(token_ids=[5], finish_reason="length",
                              usage=Usage(prompt_tokens=99, completion_tokens=1)))
    assert post.usage.prompt_tokens == 2


def test_prompt_embeds_are_never_prefilled_remotely(tokenizer):
    model = served(tokenizer, [instance("w", "127.0.0.1:1")])
    model.prefill_instances = [instance("p", "127.0.0.1:2")]
    req = GenerateRequest(request_id="r", model="m", token_ids=[])
    assert may_prefill_remotely(model, req)
    assert not may_prefill_remotely(model, msgspec.structs.replace(req, prompt_embeds=PAYLOAD))


def test_the_payload_limit_is_checked():
    with pytest.raises(ConfigError, match="max_prompt_embeds_bytes"):
        FrontendConfig(max_prompt_embeds_bytes=64 << 20)
    with pytest.raises(ConfigError, match="max_prompt_embeds_bytes"):
        FrontendConfig(max_prompt_embeds_bytes=0)

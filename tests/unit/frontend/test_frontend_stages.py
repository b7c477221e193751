"""Unit tests of the frontend's preprocess, postprocess and format stages, each alone."""

from __future__ import annotations

import json

import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.deltas import Delta, OutputSpec, TokenLogprob, ToolCallDelta, UsageCount
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable
from turbine.frontend.postprocess.format import ChatFormat, CompletionFormat, SseChunks
from turbine.frontend.postprocess.stage import Postprocess
from turbine.frontend.preprocess.stage import preprocess
from turbine.protocol.generate import GenerateOutput


@pytest.fixture
def models(tokenizer) -> ModelTable:
    table = ModelTable(registry=None, make_router=None)
    table.models["m"] = served(tokenizer, [instance("w", "127.0.0.1:1")])  # context length 2048
    return table


def body(**fields) -> bytes:
    return msgspec.json.encode(fields)


# -- preprocess ---------------------------------------------------------------------------
async def test_preprocess_chat_applies_the_template_and_fills_the_request(models, tokenizer):
    p = await preprocess(body(model="m", messages=[{"role": "user", "content": "hi"}], stop="END", n=2,
                              stream=True, stream_options={"include_usage": True}, logprobs=True,
                              top_logprobs=3), "chat", models)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert p.request.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert p.request.stop.max_tokens == 2048 - len(p.request.token_ids)  # what the context leaves
    assert (p.request.sampling.n, p.request.output.logprobs) == (2, 3)
    assert p.output == OutputSpec(stop=["END"], include_stop_str_in_output=False, skip_special_tokens=True)
    assert (p.kind, p.stream, p.include_usage) == ("chat", True, True)


async def test_preprocess_completion_takes_token_ids_and_checks_limits(models, tokenizer):
    p = await preprocess(body(model="m", prompt=[1, 2, 3], max_tokens=5), "completions", models)
    assert (p.request.token_ids, p.request.stop.max_tokens) == ([1, 2, 3], 5)
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="m", prompt=[tokenizer.vocab_size]), "completions", models)
    assert info.value.param == "prompt"
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="m", prompt=[1] * 2048), "completions", models)
    assert info.value.param == "prompt" and "context length" in info.value.message
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="m", prompt="hi", max_tokens=2048), "completions", models)
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        await preprocess(body(model="other", prompt="hi"), "completions", models)
    assert (info.value.status, info.value.param) == (404, "model")


# -- postprocess --------------------------------------------------------------------------
def postprocess(tokenizer, stop=(), n=1, parsers=list) -> Postprocess:
    return Postprocess(tokenizer, [1, 2], n, OutputSpec(stop=list(stop), include_stop_str_in_output=False,
                                                        skip_special_tokens=True), parsers)


def test_postprocess_stop_string_across_outputs_ends_the_choice(tokenizer):
    post = postprocess(tokenizer, stop=["STOP"])
    ids = tokenizer.encode(" one ST", add_special_tokens=False), tokenizer.encode("OP two", add_special_tokens=False)
    first = post.apply(GenerateOutput(token_ids=ids[0]))
    second = post.apply(GenerateOutput(token_ids=ids[1]))
    assert first.text + second.text == " one " and second.finish_reason == "stop"
    assert post.finished == [True] and post.usage.completion_tokens == len(ids[0]) + len(ids[1])
    assert post.apply(GenerateOutput(token_ids=[5], finish_reason="length")) is None  # already done


def test_postprocess_runs_each_choice_through_its_parser_chain(tokenizer):
    class ThinkingParser:  # everything before the end is reasoning, the end is the answer
        def push(self, delta):
            if delta.finish_reason is None:
                return Delta(delta.index, reasoning=delta.text)
            return delta

        def finish(self, delta):
            return Delta(delta.index, text="[answer]", finish_reason=delta.finish_reason)

    post = postprocess(tokenizer, n=2, parsers=lambda: [ThinkingParser()])
    word = tokenizer.encode(" thought", add_special_tokens=False)
    d = post.apply(GenerateOutput(token_ids=word, index=1))
    assert (d.index, d.reasoning, d.text) == (1, " thought", "")
    d = post.apply(GenerateOutput(token_ids=[], index=1, finish_reason="stop"))
    assert (d.text, d.finish_reason, post.finished) == ("[answer]", "stop", [False, True])


# -- format -------------------------------------------------------------------------------
def test_chat_format_whole_and_streamed(tokenizer):
    fmt = ChatFormat(tokenizer, "m", "abc", with_logprobs=False)
    deltas = [Delta(0, text="Let me check.", reasoning="user wants weather"),
              Delta(0, tool_calls=[ToolCallDelta(0, id="call_1", name="weather", arguments='{"city":')]),
              Delta(0, tool_calls=[ToolCallDelta(0, arguments=' "Paris"}')], finish_reason="tool_calls")]
    whole = json.loads(fmt.response([fmt.choice(0, deltas)], UsageCount(3, 4, 1)))
    assert whole["id"] == "chatcmpl-abc" and whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me check." and message["reasoning_content"] == "user wants weather"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    sse = SseChunks(fmt, include_usage=False)
    chunk = json.loads(sse.chunk([fmt.chunk_choice(deltas[1])])[len(b"data: "):])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":'}}]
    assert fmt.opening(2)[0][1]["delta"] == {"role": "assistant", "content": ""}


def test_completion_format_with_logprobs(tokenizer):
    fmt = CompletionFormat(tokenizer, "m", "abc", with_logprobs=True)
    hi = tokenizer.encode("hi", add_special_tokens=False)[0]
    deltas = [Delta(0, text="hi", logprobs=[TokenLogprob(hi, -0.5, [(hi, -0.5)])], finish_reason="length")]
    choice = fmt.choice(0, deltas)
    assert choice["text"] == "hi" and choice["logprobs"]["tokens"] == ["hi"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5] and choice["logprobs"]["top_logprobs"] == [{"hi": -0.5}]
    sse = SseChunks(fmt, include_usage=True)
    chunk = json.loads(sse.chunk([fmt.chunk_choice(deltas[0])])[len(b"data: "):])
    assert chunk["object"] == "text_completion" and chunk["usage"] is None and chunk["id"] == "cmpl-abc"
    assert fmt.opening(1) == []

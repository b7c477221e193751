"""tools.py: the tool fields' checks, the constraint forcing a call, the parser chain a request
gets from its model card, and the postprocess stage running that chain (streamed = whole)."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable
from turbine.frontend.postprocess.format import ChatFormat
from turbine.frontend.postprocess.stage import Postprocess
from turbine.frontend.preprocess.stage import preprocess
from turbine.protocol.generate import GenerateOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def table(tokenizer, tool_call_parser=None, reasoning_parser=None) -> ModelTable:
    models = ModelTable(registry=None, make_router=None)
    model = served(tokenizer, [instance("w", "127.0.0.1:1")])
    model.card = msgspec.structs.replace(model.card, tool_call_parser=tool_call_parser,
                                         reasoning_parser=reasoning_parser)
    models.models["m"] = model
    return models


async def prep(models, **fields):
    return await preprocess(msgspec.json.encode({"model": "m", "messages": USER, **fields}), "chat", models)


def run(tokenizer, prepared, text: str, pieces: int, finish: str = "stop") -> dict:
    """The model's `text` through the postprocess stage in `pieces` outputs (token-aligned), then
    formatted as the whole chat message; the EOS token ends it when it stopped by itself."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if finish == "stop":
        ids.append(tokenizer.eos_token_ids[0])
    post = Postprocess(tokenizer, prepared.request.token_ids, 1, prepared.output, parsers=prepared.output.parsers)
    step = max(1, -(-len(ids) // pieces))
    chunks = [ids[i:i + step] for i in range(0, len(ids), step)]
    deltas = [post.apply(GenerateOutput(token_ids=c, finish_reason=finish if k == len(chunks) - 1 else None))
              for k, c in enumerate(chunks)]
    choice = ChatFormat(tokenizer, "m", "r", False).choice(0, [d for d in deltas if d is not None])
    for call in choice["message"].get("tool_calls", ()):
        call["id"] = "call_x" if call["id"].startswith("call_") else call["id"]
    return choice


# -- request checks -------------------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": ["x"]}]}, "messages"),
])
async def test_malformed_tool_fields_are_400s_naming_the_field(tokenizer, fields, param):
    with pytest.raises(RequestError) as info:
        await prep(table(tokenizer, "hermes"), **fields)
    assert (info.value.status, info.value.param) == (400, param)


async def test_auto_needs_a_tool_call_parser(tokenizer):
    """As vLLM: tools with auto (said or the default) on a model without a parser is a 400."""
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(RequestError, match="--dyn-tool-call-parser") as info:
            await prep(table(tokenizer), **fields)
        assert info.value.param == "tool_choice"
    # none, required and named work without one; tools still reach the template with none (as vLLM)
    for choice in ("none", "required", {"type": "function", "function": {"name": "get_weather"}}):
        await prep(table(tokenizer), tools=[WEATHER], tool_choice=choice)


# -- the forced call's constraint -------------------------------------------------------------
async def test_named_choice_constrains_to_the_tools_parameters(tokenizer):
    p = await prep(table(tokenizer), tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(p.request.structured_outputs.json) == WEATHER["function"]["parameters"]
    p = await prep(table(tokenizer), tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                          "function": {"name": "get_time"}})
    assert json.loads(p.request.structured_outputs.json) == {"type": "object", "properties": {}}
    assert (await prep(table(tokenizer, "hermes"), tools=[WEATHER])).request.structured_outputs is None


@pytest.mark.parametrize("parallel", [None, False])
async def test_required_choice_schema(tokenizer, parallel):
    p = await prep(table(tokenizer), tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(p.request.structured_outputs.json)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    if parallel is False:
        jsonschema.validate(ok[:1], schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(ok, schema)
    else:
        jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


async def test_named_call_output(tokenizer):
    p = await prep(table(tokenizer), tools=[WEATHER], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    whole = run(tokenizer, p, '{"city": "Paris"}', 1)
    assert whole == {"index": 0, "logprobs": None, "finish_reason": "stop",  # "stop" for a named call, as OpenAI
                     "message": {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_x", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}
    assert all(run(tokenizer, p, '{"city": "Paris"}', k) == whole for k in range(2, 9))


async def test_required_calls_output(tokenizer):
    p = await prep(table(tokenizer), tools=[WEATHER, TIME], tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    whole = run(tokenizer, p, text, 1)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(run(tokenizer, p, text, k) == whole for k in range(2, 12))


async def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    p = await prep(table(tokenizer, "hermes"), tools=[WEATHER, TIME], parallel_tool_calls=False)
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for k in (1, 3, 7):
        calls = run(tokenizer, p, text, k)["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    p = await prep(table(tokenizer, "hermes"), tools=[WEATHER, TIME])
    assert len(run(tokenizer, p, text, 1)["message"]["tool_calls"]) == 2


# -- the chain from the model card ------------------------------------------------------------
async def test_auto_runs_the_cards_parsers_streamed_as_whole(tokenizer):
    p = await prep(table(tokenizer, "hermes", "qwen3"), tools=[WEATHER])
    text = ('<think>Paris, so weather.</think>Let me check.'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    whole = run(tokenizer, p, text, 1)
    assert whole["finish_reason"] == "tool_calls"
    msg = whole["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Paris, so weather.", "Let me check.")
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    n = len(tokenizer.encode(text, add_special_tokens=False)) + 1
    for k in range(2, n + 1):  # every way of cutting the output into k outputs
        assert run(tokenizer, p, text, k) == whole, k


async def test_reasoning_parser_alone_and_enable_thinking(tokenizer):
    text = "<think>hmm</think>Hi"
    p = await prep(table(tokenizer, None, "qwen3"))  # no tools: the reasoning parser still runs
    assert run(tokenizer, p, text, 3)["message"] == {"role": "assistant", "content": "Hi", "reasoning_content": "hmm"}
    p = await prep(table(tokenizer, None, "qwen3"), chat_template_kwargs={"enable_thinking": False})
    assert run(tokenizer, p, text, 3)["message"] == {"role": "assistant", "content": text}
    p = await prep(table(tokenizer, "hermes", "qwen3"), tools=[WEATHER], tool_choice="none")
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert run(tokenizer, p, call, 2)["message"] == {"role": "assistant", "content": call}  # none: not parsed


async def test_special_token_markers_reach_the_parser(tokenizer):
    """mistral's [TOOL_CALLS] (a special token in its models): the detokenizer keeps special
    tokens for such parsers, and still drops the end-of-sequence token."""
    p = await prep(table(tokenizer, "mistral"), tools=[WEATHER])
    assert p.output.skip_special_tokens is False
    assert (await prep(table(tokenizer, "hermes"), tools=[WEATHER])).output.skip_special_tokens is True
    whole = run(tokenizer, p, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', 4)
    assert whole["message"]["content"] == "Sure."
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    plain = await prep(table(tokenizer, "mistral"), tools=[WEATHER], tool_choice="none")
    assert run(tokenizer, plain, "Hi there", 2)["message"]["content"] == "Hi there"  # no <|im_end|>


async def test_tool_messages_reach_a_template_without_tool_support(tokenizer):
    """SmolLM2's template knows nothing of tool calls (and fails on null content): the call is
    written into the assistant's content, hermes-style; the tool's answer goes as role tool."""
    assert not tokenizer.renders_tool_calls
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    p = await prep(table(tokenizer), messages=messages, tools=[WEATHER], tool_choice="none")
    text = tokenizer.decode(p.request.token_ids, skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<|im_end|>') in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text

"""/v1/messages (Anthropic's Messages API): the body -> chat body conversion and what it refuses,
the message and stream events built from deltas (read by the official `anthropic` client's own
stream accumulator), and the route in-process with the official client against a request-plane
worker: whole, streamed, count_tokens, errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx2
import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from anthropic._models import construct_type

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from tests.unit.frontend.apis.test_responses import Worker
from turbine.frontend.apis import anthropic as messages
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.deltas import Delta, ToolCallDelta, UsageCount
from turbine.frontend.errors import RequestError
from turbine.frontend.http.api import asgi_app
from turbine.protocol.generate import GenerateRequest
from turbine.runtime.request_plane import RequestPlaneServer


def convert(**body) -> dict:
    return messages.chat_body(messages.decode_messages_request(msgspec.json.encode(
        {"model": "m", "max_tokens": 10, **body})))


def refused(param: str, **body) -> None:
    with pytest.raises(RequestError) as info:
        convert(**body)
    assert info.value.param == param, info.value.message


def test_a_tool_loop_transcript_becomes_chat_messages():
    chat = convert(system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                   messages=[
                       {"role": "user", "content": "weather in Paris?"},
                       {"role": "assistant", "content": [
                           {"type": "thinking", "thinking": "use the tool", "signature": ""},
                           {"type": "text", "text": "Checking."},
                           {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
                           {"type": "text", "text": "and tomorrow?"}]}],
                   tools=[{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
                   top_k=5, metadata={"user_id": "u"}, thinking={"type": "disabled"})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
        {"role": "user", "content": "and tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                               "description": "d"}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["stop"], chat["top_k"], chat["user"],
            chat["max_completion_tokens"], chat["chat_template_kwargs"]) == (
        "required", False, ["END"], 5, "u", 10, {"enable_thinking": False})
    assert convert(messages=[{"role": "user", "content": "x"}], tool_choice={"type": "tool", "name": "f"},
                   tools=[{"name": "f", "input_schema": {"type": "object"}}])["tool_choice"] == {
        "type": "function", "function": {"name": "f"}}
    fmt = convert(messages=[{"role": "user", "content": "x"}],
                  output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert fmt["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("param, body", [
    ("max_tokens", {"max_tokens": None}),
    ("container", {"container": "c"}),
    ("mcp_servers", {"mcp_servers": [{"url": "x"}]}),
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("frobnicate", {"frobnicate": 1}),
    ("messages", {"messages": []}),
    ("messages[0].role", {"messages": [{"role": "system", "content": "x"}]}),
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
    ("messages[0].content[0].source", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
    ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tools[0].input_schema", {"tools": [{"name": "f"}]}),
    ("tool_choice.type", {"tool_choice": {"type": "sometimes"}}),
    ("output_config.effort", {"output_config": {"effort": "high"}}),
    ("metadata.tags", {"metadata": {"tags": ["x"]}}),
    ("cache_control", {"cache_control": {"type": "forever"}}),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(param, body):
    body.setdefault("messages", [{"role": "user", "content": "x"}])
    refused(param, **body)


def test_every_field_of_the_official_clients_create_params_is_known():
    from anthropic.types.message_create_params import MessageCreateParamsBase

    known = set(messages.MessagesRequest.__struct_fields__) | set(messages.REFUSED_FIELDS)
    assert set(MessageCreateParamsBase.__annotations__) - known == set()


def build(deltas: list[Delta], usage=UsageCount(7, 3), stop_sequence=None):
    b = messages.MessageBuilder(messages.decode_messages_request(msgspec.json.encode(
        {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]})), "msg_1", "m", 7)
    events = b.start()
    for d in deltas:
        events += b.push(d)
    events += b.finish(usage, stop_sequence)
    snapshot, bufs = None, {}
    for e in events:  # the official client's accumulator
        snapshot = accumulate_event(event=construct_type(type_=RawMessageStreamEvent, value=e),
                                    current_snapshot=snapshot, json_bufs=bufs)
    return events, snapshot


def test_stream_events_accumulate_in_the_official_client_to_text_and_tool_use_blocks():
    events, message = build([Delta(0, reasoning="hmm"), Delta(0, "Let me"), Delta(0, " check."),
                             Delta(0, tool_calls=[ToolCallDelta(0, id="c1", name="f", arguments='{"a"')]),
                             Delta(0, tool_calls=[ToolCallDelta(0, arguments=': 1}')]),
                             Delta(0, finish_reason="tool_calls")])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[1].text == "Let me check." and message.content[2].input == {"a": 1}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 3
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"


def test_a_stop_sequence_and_a_cut_call_are_named():
    _, message = build([Delta(0, "one two", finish_reason="stop")], stop_sequence="END")
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    b = messages.MessageBuilder(messages.decode_messages_request(msgspec.json.encode(
        {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})), "msg_1", "m", 7)
    b.push(Delta(0, tool_calls=[ToolCallDelta(0, id="c1", name="f", arguments='{"a": ')]))
    b.push(Delta(0, finish_reason="length"))
    whole = b.whole(UsageCount(7, 3), None)
    assert whole["stop_reason"] == "max_tokens" and whole["content"] == []  # no pretend call


# -- through the app with the official client --------------------------------------------
@pytest.fixture
async def client(tokenizer):
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    frontend = Frontend(FrontendConfig(api_key="secret"))
    frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    c = anthropic.AsyncAnthropic(base_url="http://frontend", api_key="secret", http_client=http, max_retries=0)
    yield c
    await c.close()
    await frontend.client.close()
    await server.stop()


async def test_create_stream_and_count_tokens_with_the_official_client(client, tokenizer):
    kwargs = dict(model="m", max_tokens=20, system="be brief", messages=[{"role": "user", "content": "hi"}])
    m = await client.messages.create(**kwargs)
    assert m.content[0].text == " hello world" and m.stop_reason == "end_turn" and m.role == "assistant"
    prompt = tokenizer.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert m.usage.input_tokens == len(prompt) and m.usage.output_tokens == 2
    async with client.messages.stream(**kwargs) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == final.content[0].text == " hello world"
    counted = await client.messages.count_tokens(model="m", system="be brief",
                                                 messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == len(prompt)


async def test_errors_come_in_anthropics_shape(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                     extra_body={"frobnicate": 1})
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": info.value.body["error"]["message"]}}
    assert "frobnicate" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    bad_key = client.with_options(api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as info:
        await bad_key.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        await bad_key.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])

"""/v1/responses: the Responses body -> chat body conversion (and the fields it refuses), the
output items and stream events built from deltas (parsed by the official client's own stream
state), and the route in-process with the official client against a request-plane worker."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.apis import responses
from turbine.frontend.apis.response_events import ResponseBuilder
from turbine.frontend.apis.responses import decode_responses_request, messages_of
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.deltas import Delta, ToolCallDelta, UsageCount
from turbine.frontend.errors import RequestError, WorkerFailed
from turbine.frontend.http.api import asgi_app
from turbine.frontend.preprocess.schemas import ChatCompletionRequest, ResponsesRequest
from turbine.frontend.preprocess.structured import JsonSchemaFormat, ResponseFormat
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
from turbine.runtime.errors import RequestFailed
from turbine.runtime.request_plane import RequestPlaneServer


def request(**body) -> ResponsesRequest:
    return decode_responses_request(msgspec.json.encode({"model": "m", **body}))


def convert(**body) -> ChatCompletionRequest:
    return responses.chat_request(request(**body))


def refused(param: str, **body) -> RequestError:
    with pytest.raises(RequestError) as info:
        responses.chat_request(request(**body))
    assert info.value.param == param, info.value.message
    assert info.value.status == 400
    return info.value


# -- conversion ---------------------------------------------------------------------------
def test_a_string_input_and_instructions_become_system_and_user_messages():
    chat = convert(input="hi", instructions="be brief", max_output_tokens=7, temperature=0.5, top_p=0.9,
                   user="u1", stream=True)
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.user, chat.stream) == (
        7, 0.5, 0.9, "u1", True)


def test_an_agent_loop_transcript_becomes_chat_messages():
    """What a client sends back after a tool call: its input, our output items (as the client
    dumps them, ids and statuses included), and the tool's result."""
    items = [
        {"role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "call the tool"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert messages_of(items, None) == [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "call the tool", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_input_image_parts_become_chat_image_url_parts_in_order():
    origins: dict[str, str] = {}
    req = request(instructions="be brief", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:one", "detail": "auto"},
        {"type": "input_image", "image_url": "https://x/two.png"}]}])
    assert responses.chat_request(req, origins).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:one"}},
                                     {"type": "image_url", "image_url": {"url": "https://x/two.png"}}]}]
    # The media stage's errors name messages[1]...: the client sent input[0]...
    assert origins == {"messages[1].content[1].image_url": "input[0].content[1].image_url",
                       "messages[1].content[2].image_url": "input[0].content[2].image_url"}
    # Without images, text parts stay one string (as before).
    assert convert(input=[{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]}]).messages == [
        {"role": "user", "content": "ab"}]


def test_tools_tool_choice_and_text_format_become_their_chat_fields():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat = convert(input="x", tools=[{"type": "function", "name": "weather", "description": "d",
                                      "parameters": params, "strict": True}],
                   tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                   text={"format": {"type": "json_schema", "name": "out", "schema": params, "strict": True}})
    assert chat.tools == [{"type": "function", "function": {"name": "weather", "description": "d",
                                                            "parameters": params, "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="out", schema=params, strict=True))
    assert convert(input="x", tool_choice="required").tool_choice == "required"
    assert convert(input="x", text={"format": {"type": "json_object"}}).response_format == ResponseFormat(
        type="json_object")
    assert convert(input="x", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize("param, body", [
    ("reasoning", {"input": "x", "reasoning": {"effort": "high"}}),
    ("include[1]", {"input": "x", "include": ["reasoning.encrypted_content", "file_search_call.results"]}),
    ("top_logprobs", {"input": "x", "top_logprobs": 3}),
    ("truncation", {"input": "x", "truncation": "auto"}),
    ("service_tier", {"input": "x", "service_tier": "flex"}),
    ("stream_options", {"input": "x", "stream_options": {"include_obfuscation": False}}),
    ("stream_options.include_obfuscation", {"input": "x", "stream": True,
                                            "stream_options": {"include_obfuscation": True}}),
    ("input", {"input": []}),
    ("input", {"input": 5}),
    ("input[0].role", {"input": [{"role": "tool", "content": "x"}]}),
    ("input[0].type", {"input": [{"type": "item_reference", "id": "x"}]}),
    ("input[0].content[0]", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
    ("input[0].content[1].file_id", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "x"}, {"type": "input_image", "file_id": "file-1", "detail": "auto"}]}]}),
    ("input[0].content[0].detail", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:x", "detail": "high"}]}]}),
    ("input[0].content[0].image_url", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
    ("input[0].content[0].prompt_cache_breakpoint", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:x", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]}),
    ("input[0].content[0]", {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}]}),
    ("input[0].content[0].text", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
    ("input[0].name", {"input": [{"role": "user", "content": "x", "name": "bob"}]}),
    ("input[0].call_id", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
    ("input[0].encrypted_content", {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}),
    ("tools[0].type", {"input": "x", "tools": [{"type": "web_search"}]}),
    ("tools[0].name", {"input": "x", "tools": [{"type": "function", "parameters": {}}]}),
    ("tools[0].function", {"input": "x", "tools": [{"type": "function", "name": "f", "function": {}}]}),
    ("tool_choice", {"input": "x", "tool_choice": "any"}),
    ("tool_choice", {"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}),
    ("text.format.type", {"input": "x", "text": {"format": {"type": "grammar"}}}),
    ("text.format.schema", {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
    ("text.format", {"input": "x", "text": {"format": "json"}}),
    ("text.format.name", {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}),
    ("text.format.strict", {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {},
                                                              "strict": "yes"}}}),
    ("text.verbosity", {"input": "x", "text": {"verbosity": "low"}}),
    ("metadata", {"input": "x", "metadata": {str(i): "v" for i in range(17)}}),
    ("temperature", {"input": "x", "temperature": "hot"}),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(param, body):
    refused(param, **body)


@pytest.mark.parametrize("name", sorted(responses.REFUSED_FIELDS))
def test_every_client_field_not_acted_on_is_refused_by_name_and_null_is_fine(name):
    with pytest.raises(RequestError) as info:
        request(input="x", **{name: {"x": 1}})
    assert info.value.param == name and "not supported" in info.value.message
    assert convert(input="x", **{name: None}).messages  # what a client sends for "not given"


def test_every_field_of_the_official_clients_create_params_is_known():
    """Walks openai's ResponseCreateParams: each field is honoured (a struct field) or refused by name."""
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    given = set(ResponseCreateParamsBase.__annotations__)
    known = set(ResponsesRequest.__struct_fields__) | set(responses.REFUSED_FIELDS)
    assert given - known == set()


async def test_stored_state_fields_are_refused_by_name_without_a_store():
    for name, value in (("store", True), ("previous_response_id", "resp_1"), ("conversation", "conv_1"),
                        ("background", True)):
        with pytest.raises(RequestError) as info:
            await responses.stored_context(request(input="x", **{name: value}), None, "")
        assert info.value.param == name and "--response-store off" in info.value.message
    assert (await responses.stored_context(request(input="x"), None, "")).store is False


def test_harmless_forms_of_refusable_fields_are_accepted():
    convert(input="x", store=False, reasoning={"effort": None, "summary": None}, previous_response_id=None,
            text={"format": {"type": "text"}, "verbosity": None}, metadata={"k": "v"})


# -- deltas -> items and events, read back by the official client's stream state ------------
def builder(**req) -> ResponseBuilder:
    return ResponseBuilder(request(**{"input": "x", **req}), "resp_1", "m", lambda text: len(text.split()))


def client_final(events: list[dict], tools=()) -> tuple[object, list[str]]:
    """Feeds the events to the openai client's own stream accumulator: its final response and
    the event types, in order. Raises where the client would."""
    state = ResponseStreamState(input_tools=list(tools), text_format=openai.omit)
    for e in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return state._completed_response, [e["type"] for e in events]


def run_builder(b: ResponseBuilder, deltas: list[Delta], usage=UsageCount(5, 9)) -> list[dict]:
    events = b.start()
    for d in deltas:
        events += b.push(d)
    return events + b.finish(usage)


def test_text_deltas_become_one_message_and_the_event_sequence_the_client_expects():
    events = run_builder(builder(), [Delta(0, "Hel"), Delta(0, "lo"), Delta(0, "!", finish_reason="stop")])
    final, types = client_final(events)
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert final.output_text == "Hello!" and final.status == "completed"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (5, 9, 14)
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello!"


def test_reasoning_then_tool_calls_become_reasoning_and_function_call_items():
    deltas = [
        Delta(0, reasoning="need the "), Delta(0, reasoning="weather"),
        Delta(0, "\n"),  # the gap a parser leaves before a call: no message item for it
        Delta(0, tool_calls=[ToolCallDelta(0, id="call_a", name="weather", arguments='{"city": ')]),
        Delta(0, tool_calls=[ToolCallDelta(0, arguments='"Paris"}')]),
        Delta(0, tool_calls=[ToolCallDelta(1, id="call_b", name="time", arguments="{}")], finish_reason="tool_calls"),
    ]
    events = run_builder(builder(), deltas)
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}},
             {"type": "function", "name": "time", "parameters": {"type": "object"}}]
    final, types = client_final(events, tools)
    assert [o.type for o in final.output] == ["reasoning", "function_call", "function_call"]
    assert final.output[0].content[0].text == "need the weather"
    assert [(o.call_id, o.name, o.arguments) for o in final.output[1:]] == [
        ("call_a", "weather", '{"city": "Paris"}'), ("call_b", "time", "{}")]
    assert types.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in types
    assert types.count("response.function_call_arguments.delta") == 3
    assert types.count("response.function_call_arguments.done") == 2
    assert final.usage.output_tokens_details.reasoning_tokens == 3  # this test's counter: words
    dones = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in dones] == ['{"city": "Paris"}', "{}"]


def test_without_a_tokenizer_text_mode_leaves_the_reasoning_count_out():
    b = ResponseBuilder(request(input="x"), "resp_1", "m", None)
    usage = run_builder(b, [Delta(0, reasoning="hmm"), Delta(0, "ok", finish_reason="stop")])[-1]["response"]["usage"]
    assert "output_tokens_details" not in usage and usage["output_tokens"] == 9


def test_text_then_a_tool_call_keeps_both_in_order():
    events = run_builder(builder(), [Delta(0, "Let me check."),
                                     Delta(0, tool_calls=[ToolCallDelta(0, id="c", name="f", arguments="{}")]),
                                     Delta(0, finish_reason="tool_calls")])
    final, _ = client_final(events)
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me check."


def test_whitespace_is_kept_when_it_is_all_the_model_said():
    final, _ = client_final(run_builder(builder(), [Delta(0, "\n\n", finish_reason="stop")]))
    assert final.output_text == "\n\n"


def test_a_length_stop_is_an_incomplete_response():
    events = run_builder(builder(max_output_tokens=3), [Delta(0, "a b c", finish_reason="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["max_output_tokens"] == 3


def test_the_response_echoes_what_was_asked():
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    b = builder(instructions="i", temperature=0.3, metadata={"k": "v"}, user="u", tools=tools, tool_choice="required",
                parallel_tool_calls=False, text={"format": {"type": "json_object"}})
    body = b.response("completed", UsageCount(1, 2))
    assert (body["instructions"], body["temperature"], body["metadata"], body["user"], body["tools"],
            body["tool_choice"], body["parallel_tool_calls"], body["text"], body["store"]) == (
        "i", 0.3, {"k": "v"}, "u", tools, "required", False, {"format": {"type": "json_object"}}, False)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    b = builder()
    events = b.start() + b.push(Delta(0, "Hi")) + b.fail(WorkerFailed("worker died", "engine_failure"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "worker died" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# -- the route, in-process, with the official client --------------------------------------
class Worker:
    """Answers " hello world" in two outputs, or fails after the first when told to."""

    def __init__(self, tokenizer):
        self.parts = [tokenizer.encode(" hello", add_special_tokens=False),
                      tokenizer.encode(" world", add_special_tokens=False)]
        self.fail_after_first = False
        self.delay = 0.0  # seconds between the two outputs, beyond the usual 50 ms
        self.seen: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest, ctx):
        self.seen.append(req)
        yield GenerateOutput(token_ids=self.parts[0])
        await asyncio.sleep(0.05 + self.delay)
        if self.fail_after_first:
            raise RequestFailed("engine fell over", code="engine_failure")
        n = sum(len(p) for p in self.parts)
        yield GenerateOutput(token_ids=self.parts[1], finish_reason="stop",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=n))


@pytest.fixture
async def stack(tokenizer):
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    frontend = Frontend(FrontendConfig())
    frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="k", http_client=http, max_retries=0)
    yield worker, client
    await client.close()
    await frontend.client.close()
    await server.stop()


async def test_create_returns_a_response_object(stack, tokenizer):
    worker, client = stack
    reply = await client.responses.create(model="m", input="hi", instructions="be brief", max_output_tokens=20,
                                          temperature=0.0)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status == "completed"
    assert reply.output_text == " hello world" and reply.output[0].type == "message"
    req = worker.seen[-1]
    expected = tokenizer.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert req.token_ids == expected and req.stop.max_tokens == 20 and req.sampling.temperature == 0.0
    assert reply.usage.input_tokens == len(expected) and reply.usage.output_tokens == 2


async def test_stream_events_reassemble_to_the_final_text(stack):
    _, client = stack
    async with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == " hello world"
    raw = await client.responses.create(model="m", input="hi", stream=True)
    events = [e async for e in raw]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_failure_after_the_first_token_ends_the_stream_with_response_failed(stack):
    worker, client = stack
    worker.fail_after_first = True
    raw = await client.responses.create(model="m", input="hi", stream=True)
    events = [e async for e in raw]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "engine fell over" in events[-2].message


async def test_bad_requests_are_400s_naming_the_field(stack):
    """In OpenAI's error shape, the field named in `param` and in the message: those the Responses
    decoder checks and those the chat path's checks find in the chat request built from it."""
    _, client = stack
    for kwargs, param in [({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                          ({"temperature": "hot"}, "temperature"),
                          ({"temperature": 2.5}, "temperature"),
                          ({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {},
                                                "strict": "yes"}}}, "text.format.strict")]:
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="m", input="hi", **kwargs)
        error = info.value.body
        assert info.value.status_code == 400 and error["type"] == "invalid_request_error", error
        assert error["param"] == param and param.split("[")[0] in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:  # over the context: the chat path's length check
        await client.responses.create(model="m", input="hi", max_output_tokens=10**6)
    assert info.value.body["param"] == "max_output_tokens", info.value.body
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="nope", input="hi")


def test_the_encoded_stream_path_writes_the_events_the_dict_path_builds():
    """push_encoded / start_encoded (the stream's fast path) against push / start, event for event."""
    import json

    deltas = [Delta(0, reasoning="hmm"), Delta(0, "Hello"), Delta(0, " there"), Delta(0, ","),
              Delta(0, tool_calls=[ToolCallDelta(0, id="c", name="f", arguments="{}")]), Delta(0, finish_reason="stop")]

    def parsed(data: bytes) -> list[dict]:
        return [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]

    a, b = builder(), builder()
    b.id, b.created_at = a.id, a.created_at
    slow = [e for e in a.start()] + [e for d in deltas for e in a.push(d)] + a.finish(UsageCount(3, 4))
    fast = parsed(b.start_encoded()) + [e for d in deltas for e in parsed(b.push_encoded(d))] + b.finish(
        UsageCount(3, 4))
    import re

    ids = lambda events: re.sub(r'"(rs|msg|fc)_[0-9a-f]+"', '"ID"', json.dumps(events, sort_keys=True))  # noqa: E731
    assert ids(fast) == ids(slow)
    assert fast[-1]["response"]["output"][1]["content"][0]["text"] == "Hello there,"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_of_an_incomplete_response():
    events = run_builder(builder(max_output_tokens=3), [
        Delta(0, tool_calls=[ToolCallDelta(0, id="c", name="f", arguments='{"city": "Par')]),
        Delta(0, finish_reason="length")])
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["status"] == "incomplete"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["status"] == "incomplete"

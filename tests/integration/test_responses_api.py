"""POST /v1/responses through the real frontend and real vLLM CPU workers (the shared
cluster), driven by the official `openai` client: create, stream, tools, and refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.conftest import MODEL

QUESTION = "What is the capital of France? Answer in one sentence."


def test_create_answers_with_a_message_item(client):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="You are a geography teacher.",
                                max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text.strip()
    assert 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Same text as the chat endpoint for the same conversation, greedy.
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are a geography teacher."}, {"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_deltas_equal_the_final_text_and_the_unstreamed_text(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                  max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # the model stops well before max_output_tokens
    assert "".join(deltas) == final.output_text == whole.output_text and final.status == "completed"
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_bad_input_is_a_named_400_and_the_server_keeps_serving(client):
    for kwargs, param in [({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
                          ({"input": "hi", "prompt_cache_key": "k"}, "prompt_cache_key"),
                          ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
                           "input[0].content[0]"),
                          # (a text model: its worker runs without --enable-multimodal)
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input"),
                          ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"input": "hi", "extra_body": {"frobnicate": True}}, "frobnicate")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, max_output_tokens=4, **kwargs)
        assert info.value.body["param"] == param
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=4).output_text
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123abc", max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"


def test_include_output_text_logprobs_gives_each_tokens_logprob_whole_and_streamed(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**kwargs)
    part = whole.output[0].content[0]
    # every output token's, but the end-of-sequence token's, which is no text
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert whole.usage.output_tokens - 1 <= len(part.logprobs) <= whole.usage.output_tokens
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, include=[])
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast of a city",
           "parameters": WEATHER_PARAMS, "strict": True}
ASK = "What will the weather be in Paris for the next 3 days?"


def _only_call(response):
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    return calls[0]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_tool_choice_returns_a_function_call_item_whose_arguments_validate(client, tool_choice):
    # `required` makes a list of calls: more tokens than one call's arguments
    kwargs = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                  max_output_tokens=64, temperature=0)
    whole = _only_call(client.responses.create(**kwargs))
    with client.responses.stream(**kwargs) as stream:
        arg_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = _only_call(stream.get_final_response())
    assert "".join(arg_deltas) == streamed.arguments == whole.arguments
    if isinstance(tool_choice, dict):  # the engine's output as it is (`required`'s list is re-serialized by its parser)
        # compact JSON (the worker's --json-whitespace default): no whitespace outside strings
        assert whole.arguments == json.dumps(json.loads(whole.arguments), separators=(",", ":"), ensure_ascii=False)


def test_an_agent_loop_sends_the_tool_result_back_and_gets_an_answer(client):
    """The official client's loop: the response's output items go back as input, with the
    tool's result as a function_call_output."""
    conversation: list = [{"role": "user", "content": ASK}]
    first = client.responses.create(model=MODEL, input=conversation, tools=[WEATHER], max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = _only_call(first)
    conversation += first.output
    conversation.append({"type": "function_call_output", "call_id": call.call_id,
                         "output": json.dumps({"forecast": ["sun", "rain", "sun"]})})
    final = client.responses.create(model=MODEL, input=conversation, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=30, temperature=0)
    assert final.output_text.strip() and not [o for o in final.output if o.type == "function_call"]
    assert final.usage.input_tokens > first.usage.input_tokens


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


def test_text_format_json_schema_is_enforced_and_parses(client):
    """`text.format` reaches the engine's structured outputs: the official client's parse()."""
    r = client.responses.parse(model=MODEL, input="Name a big city in Europe as JSON.", text_format=City,
                               max_output_tokens=40, temperature=0)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name
    loose = client.responses.create(model=MODEL, input="Name a big city in Europe.", max_output_tokens=30,
                                    text={"format": {"type": "json_object"}}, temperature=0)
    assert isinstance(json.loads(loose.output_text), dict)

"""Tool calls and reasoning end to end: real vLLM CPU workers on SmolLM2 (the shared cluster,
whose workers run --dyn-tool-call-parser hermes --dyn-reasoning-parser qwen3), the official
`openai` client, its stream helpers reassembling tool calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from openai import OpenAI

from tests.integration.conftest import MODEL
from tests.integration.procs import base_env, instances_of, start_frontend, start_mocker, wait_until, worker_ready

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
                                            "parameters": WEATHER_PARAMS}}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": TIME_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0)


def _check_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def completion(client, stream: bool, **kwargs):
    """The whole completion; streamed, as the official client's stream helper reassembles it."""
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as s:
        for _ in s:
            pass
        return s.get_final_completion()


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_returns_valid_arguments(client, stream):
    r = completion(client, stream, tool_choice=NAMED, **ARGS)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named call
    assert not choice.message.content
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_calls(client, stream):
    # a list of calls takes more tokens than one call's arguments
    r = completion(client, stream, **dict(ARGS, tool_choice="required", parallel_tool_calls=False, max_tokens=64))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: at most one
    _check_calls(choice.message.tool_calls)


def test_streamed_named_call_deltas_have_openais_shape(client):
    """First fragment: index, id, type and name; later ones: argument pieces only."""
    chunks = [c for c in client.chat.completions.create(tool_choice=NAMED, stream=True, **ARGS) if c.choices]
    fragments = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert fragments[0].index == 0 and fragments[0].id.startswith("call_")
    assert fragments[0].function.name == "get_weather"
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments[1:])
    args = "".join(f.function.arguments or "" for f in fragments)
    jsonschema.validate(json.loads(args), WEATHER_PARAMS)
    whole = client.chat.completions.create(tool_choice=NAMED, **ARGS)
    assert args == whole.choices[0].message.tool_calls[0].function.arguments  # streamed = whole


THINK = r"<think>[a-z ]{1,20}</think>[A-Za-z ]{1,20}"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_think_block_lands_in_reasoning_content(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": THINK}})
    if stream:
        reasoning, content = "", ""
        for c in client.chat.completions.create(stream=True, **kwargs):
            if c.choices:
                d = c.choices[0].delta
                reasoning += getattr(d, "reasoning_content", None) or ""
                content += d.content or ""
    else:
        msg = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = msg.reasoning_content, msg.content
    assert reasoning and "<think>" not in reasoning and "</think>" not in content
    assert content and len(reasoning) <= 20 and len(content) <= 20


def test_agent_loop(client):
    """An agent's turns: the model must call the tool, gets its result back, answers."""
    messages = [{"role": "system", "content": "You answer questions with the tools you have."}, *ASK]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice=NAMED, max_tokens=40, temperature=0)
    assert first.choices[0].finish_reason == "stop"
    calls = first.choices[0].message.tool_calls
    _check_calls(calls)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        result = {"forecast": "sunny", "high_c": 24} if call.function.name == "get_weather" else {"time": "12:00"}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    # none: the answer is text (with auto, SmolLM2 imitates the call it sees in the history and
    # calls again, which the hermes parser duly returns as a call)
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=30, temperature=0)
    answer = final.choices[0]
    assert answer.message.content and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls


def test_tool_choice_errors_are_400s(client):
    import openai

    for kwargs, param in [(dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                          (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{**ARGS, **kwargs})
        assert info.value.body["param"] == param


# -- the auto path through the real frontend, on a mocker whose every answer is a fixed text ----
MOCKED = "tool-mocker"
REPLY = ('<think>They want weather.</think>Checking.<tool_call>{"name": "get_weather", "arguments": '
         '{"city": "Paris", "days": 3}}</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
         '</tool_call>')


@pytest.fixture(scope="module")
def mocked(tmp_path_factory):
    """No engine: a mocker (--reply-text REPLY, hermes and qwen3 parsers) and its own frontend."""
    root = tmp_path_factory.mktemp("tool-mocker")
    env = base_env(str(root / "discovery"))
    mocker = start_mocker("tool-mocker", env, root, "--served-model-name", MOCKED, "--speedup-ratio", "0",
                          "--reply-text", REPLY, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    frontend = start_frontend("tool-frontend", env, root)
    try:
        wait_until(lambda: worker_ready(mocker) and instances_of(frontend, MOCKED) == 1, 60, "mocker",
                   [mocker, frontend])
        yield OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        frontend.stop()
        mocker.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_and_reasoning(mocked, stream):
    kwargs = dict(model=MOCKED, messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
    r = completion(mocked, stream, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content, choice.message.reasoning_content) == ("Checking.", "They want weather.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    one = mocked.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message.tool_calls
    assert [c.function.name for c in one] == ["get_weather"]


def test_tool_choice_none_leaves_calls_as_text(mocked):
    msg = mocked.chat.completions.create(model=MOCKED, messages=ASK, tools=[WEATHER], tool_choice="none",
                                         max_tokens=200).choices[0].message
    assert msg.content == REPLY.split("</think>")[1] and not msg.tool_calls
    assert msg.reasoning_content == "They want weather."

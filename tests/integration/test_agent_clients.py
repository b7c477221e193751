"""The client libraries agents are built with, their own code against the shared cluster (real
frontend, real vLLM CPU workers on SmolLM2 with the hermes tool-call parser; the frontend keeps
stored responses in process): the OpenAI Agents SDK on its default Responses model (a function-tool
loop, `auto_previous_response_id`, `previous_response_id` across runs, a conversation) and on Chat
Completions, LangChain's `ChatOpenAI` (forced tools, streamed tool chunks, a tool loop,
`with_structured_output`, the Responses API), pydantic-ai (a structured output type), and the
official `anthropic` client (a tool loop, streamed) and instructor (TOOLS and JSON_SCHEMA modes, from
a venv of its own). Versions are pinned in pyproject's dev extra (instructor's in the Makefile).

SmolLM2-135M is small: the tests check what the libraries and the server do (calls made, items
stored, shapes parsed, contexts carried), not the quality of its answers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anthropic
import pydantic
import pytest
from openai import AsyncOpenAI

from tests.integration.conftest import MODEL

WEATHER_INSTRUCTIONS = "You answer weather questions with the get_weather tool."
SHORT = "Reply in one short sentence."


def forecast(city: str) -> str:
    return json.dumps({"city": city, "forecast": "sunny, 21 C"})


@pytest.fixture(scope="module")
def url(cluster) -> str:
    return f"{cluster['frontend'].url}/v1"


@pytest.fixture(scope="module")
def agents_sdk():
    import agents

    agents.set_tracing_disabled(True)
    return agents


def weather_agent(agents_sdk, model, calls: list[str]):
    @agents_sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather forecast of a city."""
        calls.append(city)
        return forecast(city)

    return agents_sdk.Agent(name="weather", instructions=WEATHER_INSTRUCTIONS, model=model, tools=[get_weather],
                            model_settings=agents_sdk.ModelSettings(tool_choice="get_weather", temperature=0,
                                                                    max_tokens=60))


# -- OpenAI Agents SDK ----------------------------------------------------------------------
async def test_agents_sdk_responses_model_runs_a_tool_loop_chained_by_previous_response_id(url, agents_sdk):
    """The SDK's default model: it sends `include: []` on every call; the tool's output goes back to
    the model, each turn continuing the stored one before it (auto_previous_response_id)."""
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    calls: list[str] = []
    agent = weather_agent(agents_sdk, agents_sdk.OpenAIResponsesModel(model=MODEL, openai_client=client), calls)
    result = await agents_sdk.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                         auto_previous_response_id=True)
    assert calls and [i.type for i in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]
    assert result.new_items[-1].type == "message_output_item" and result.final_output.strip()
    last = await client.responses.retrieve(result.last_response_id)
    assert last.previous_response_id is not None  # the second turn sent only the tool's output
    first = await client.responses.retrieve(last.previous_response_id)
    assert [o.type for o in first.output] == ["function_call"]
    sent = await client.responses.input_items.list(last.id)
    assert [i.type for i in sent.data] == ["function_call_output"]
    assert json.loads(sent.data[0].output)["forecast"] == "sunny, 21 C"


async def test_agents_sdk_continues_a_run_from_previous_response_id_and_a_conversation(url, agents_sdk):
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    model = agents_sdk.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents_sdk.Agent(name="chat", instructions=SHORT, model=model,
                             model_settings=agents_sdk.ModelSettings(temperature=0, max_tokens=80))
    first = await agents_sdk.Runner.run(agent, "Hi, I am Ada.")
    second = await agents_sdk.Runner.run(agent, "Who am I?", previous_response_id=first.last_response_id)
    earlier = await client.responses.retrieve(first.last_response_id)
    later = await client.responses.retrieve(second.last_response_id)
    # the follow-up's prompt holds the first turn: its input and its answer
    assert later.usage.input_tokens > earlier.usage.input_tokens + earlier.usage.output_tokens

    conversation = await client.conversations.create()
    await agents_sdk.Runner.run(agent, "Hi, I am Ada.", conversation_id=conversation.id)
    await agents_sdk.Runner.run(agent, "Who am I?", conversation_id=conversation.id)
    items = await client.conversations.items.list(conversation.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant")] * 2
    assert items.data[0].content[0].text == "Hi, I am Ada."


async def test_agents_sdk_chat_completions_model_runs_a_tool_loop(url, agents_sdk):
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    calls: list[str] = []
    agent = weather_agent(agents_sdk, agents_sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                          calls)
    result = await agents_sdk.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert calls and result.new_items[-1].type == "message_output_item" and result.final_output.strip()


# -- LangChain ------------------------------------------------------------------------------
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


def test_langchain_chat_openai_forced_and_streamed_tools_a_tool_loop_and_structured_output(url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather forecast of a city."""
        return forecast(city)

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=60, max_retries=0)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    asked = HumanMessage("What is the weather in Paris?")
    call = forced.invoke([asked])
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and isinstance(call.tool_calls[0]["args"]["city"], str)
    chunks = list(forced.stream("What is the weather in Rome?"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert len(chunks) > 2 and [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(
        [asked, call, ToolMessage(get_weather.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"])])
    assert answer.content.strip() and not answer.tool_calls
    for method in ("function_calling", "json_schema"):
        city = llm.with_structured_output(City, method=method).invoke("Name a big city in Europe.")
        assert isinstance(city, City)
    over_responses = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=40,
                                max_retries=0, use_responses_api=True)
    assert over_responses.invoke("Say hi.").text.strip()


# -- pydantic-ai ----------------------------------------------------------------------------
def test_pydantic_ai_agent_returns_its_structured_output_type(url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url, api_key="unused"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 60})
    result = agent.run_sync("Name a big city in Europe.")
    assert isinstance(result.output, City)


# -- instructor -----------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = Path(os.environ.get("TURBINE_INSTRUCTOR_PYTHON", REPO / ".instructor-venv" / "bin" / "python"))


def test_instructor_tools_and_json_schema_modes_parse_their_response_model(url):
    """instructor in its own venv (make setup builds it: its jiter pin excludes this venv's openai),
    TOOLS mode (a forced tool call) and JSON_SCHEMA mode (response_format json_schema), each parsing
    and validating its pydantic response model from what the server answered."""
    assert INSTRUCTOR_PYTHON.exists(), f"{INSTRUCTOR_PYTHON} is missing: `make setup` builds it"
    run = subprocess.run([str(INSTRUCTOR_PYTHON), str(Path(__file__).parent / "clients" / "instructor_client.py"),
                          url, MODEL], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["versions"]["instructor"] == "1.17.0", result["versions"]
    for mode in ("tool_call", "json_schema_mode"):
        city = result[mode].get("city")
        assert city and city["name"] and city["country"], (mode, result[mode])


# -- anthropic ------------------------------------------------------------------------------
WEATHER_TOOL = {"name": "get_weather", "description": "The weather forecast of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                                 "required": ["city"], "additionalProperties": False}}


async def test_anthropic_client_runs_a_tool_loop_whole_and_streamed(cluster):
    client = anthropic.AsyncAnthropic(base_url=cluster["frontend"].url, api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    # (this SDK has no temperature parameter any more; the server takes it, as older clients send it)
    kwargs = dict(model=MODEL, max_tokens=60, system=WEATHER_INSTRUCTIONS, tools=[WEATHER_TOOL],
                  extra_body={"temperature": 0})
    first = await client.messages.create(messages=messages, tool_choice={"type": "tool", "name": "get_weather"},
                                         **kwargs)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and isinstance(uses[0].input["city"], str)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": forecast(uses[0].input["city"])}]}]
    async with client.messages.stream(messages=messages, tool_choice={"type": "none"}, **kwargs) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text.strip() and final.content[-1].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > first.usage.input_tokens
    counted = await client.messages.count_tokens(model=MODEL, messages=messages, system=WEATHER_INSTRUCTIONS,
                                                 tools=[WEATHER_TOOL])
    assert counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens

"""hermes, llama3_json and mistral on recorded outputs: one-shot equals the expected calls, and
every way of streaming them equals one-shot (tests/unit/frontend/parsers/harness.py)."""

from __future__ import annotations

import pytest

from tests.unit.frontend.parsers.harness import Result, calls, check
from turbine.frontend.parsers import tool_call_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"and": [{"field": "price", "lt": 10.5}, {"tags": ["a", "b"]}]}, "limit": 5,
          "flag": None, "exact": False, "note": 'say "hi" \\ bye'}
UNICODE = {"city": "Zürich", "note": "☀️ 晴れ 😀", "escaped": "é😀"}

HERMES = [
    pytest.param('Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "celsius"}}\n</tool_call>',
                 Result("Let me check the weather.\n", calls=calls(("get_weather", WEATHER)), finish_reason="tool_calls"),
                 "stop", id="text-then-call"),
    pytest.param('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
                 Result("\n", calls=calls(("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})),
                        finish_reason="tool_calls"), "stop", id="two-calls"),
    pytest.param('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "☀️ 晴れ 😀", '
                 '"escaped": "\\u00e9\\ud83d\\ude00"}}\n</tool_call>',
                 Result(calls=calls(("get_weather", UNICODE)), finish_reason="tool_calls"), "stop", id="unicode"),
    pytest.param('<tool_call>\n{"name": "search", "arguments": {"filter": {"and": [{"field": "price", "lt": 10.50}, '
                 '{"tags": ["a", "b"]}]}, "limit": 5, "flag": null, "exact": false, "note": "say \\"hi\\" \\\\ bye"}}'
                 '\n</tool_call>',
                 Result(calls=calls(("search", NESTED)), finish_reason="tool_calls"), "stop", id="nested"),
    pytest.param('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
                 Result(calls=calls(("search", {"q": "x"})), finish_reason="tool_calls"), "stop", id="arguments-first"),
    pytest.param('Sure.\n<tool_call>\n{"name": "search", "arguments": {"query": "weather in Par',
                 Result("Sure.\n", calls=calls(("search", {"query": "weather in Par"})), finish_reason="length"),
                 "length", id="unterminated"),
    pytest.param('<tool_call>\n{"name": "search", "arguments": {"n": 1}}',
                 Result(calls=calls(("search", {"n": 1})), finish_reason="tool_calls"), "stop", id="no-end-tag"),
    pytest.param('Hmm <tool_call>{"name": "get_w',
                 Result('Hmm <tool_call>{"name": "get_w', finish_reason="length"), "length", id="cut-before-name"),
    pytest.param("The capital of France is Paris. Use <b>bold</b>, < and > freely; <tool_ and </tool_call>.",
                 Result("The capital of France is Paris. Use <b>bold</b>, < and > freely; <tool_ and </tool_call>.",
                        finish_reason="stop"), "stop", id="plain-text"),
    pytest.param("<tool_call>not json</tool_call> ok",
                 Result("<tool_call>not json</tool_call> ok", finish_reason="stop"), "stop", id="not-a-call"),
]

LLAMA3 = [
    pytest.param('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
                 Result(calls=calls(("get_weather", WEATHER)), finish_reason="tool_calls"), "stop", id="python-tag"),
    pytest.param('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                 '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
                 Result(calls=calls(("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})),
                        finish_reason="tool_calls"), "stop", id="two-calls"),
    pytest.param('{"name": "get_weather", "parameters": {"city": "Zürich", "note": "☀️ 晴れ 😀", '
                 '"escaped": "\\u00e9\\ud83d\\ude00"}}',
                 Result(calls=calls(("get_weather", UNICODE)), finish_reason="tool_calls"), "stop", id="unicode"),
    pytest.param('\n{"name": "search", "arguments": {"filter": {"and": [{"field": "price", "lt": 10.50}, '
                 '{"tags": ["a", "b"]}]}, "limit": 5, "flag": null, "exact": false, "note": "say \\"hi\\" \\\\ bye"}}',
                 Result(calls=calls(("search", NESTED)), finish_reason="tool_calls"), "stop", id="nested"),
    pytest.param('{"name": "search", "parameters": {"query": "weather in Par',
                 Result(calls=calls(("search", {"query": "weather in Par"})), finish_reason="length"),
                 "length", id="unterminated"),
    pytest.param('{"name": "get_time", "parameters": {}} Done.',
                 Result("Done.", calls=calls(("get_time", {})), finish_reason="tool_calls"), "stop", id="text-after"),
    pytest.param('I will call {"name": "get_time", "parameters": {}}',
                 Result('I will call {"name": "get_time", "parameters": {}}', finish_reason="stop"),
                 "stop", id="text-before-is-content"),
    pytest.param('{"answer": 42, "name": "Bob"} is the JSON.',
                 Result('{"answer": 42, "name": "Bob"} is the JSON.', finish_reason="stop"), "stop", id="json-not-a-call"),
    pytest.param("  Hello! How can I help you today?",
                 Result("  Hello! How can I help you today?", finish_reason="stop"), "stop", id="plain-text"),
]

MISTRAL = [
    pytest.param('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                 Result(calls=calls(("get_weather", WEATHER)), finish_reason="tool_calls"), "stop", id="one-call"),
    pytest.param('Checking both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
                 Result("Checking both.", calls=calls(("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})),
                        finish_reason="tool_calls"), "stop", id="text-then-two-calls"),
    pytest.param('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "note": "☀️ 晴れ 😀", '
                 '"escaped": "\\u00e9\\ud83d\\ude00"}}]',
                 Result(calls=calls(("get_weather", UNICODE)), finish_reason="tool_calls"), "stop", id="unicode"),
    pytest.param('[TOOL_CALLS][{"name": "search", "arguments": {"filter": {"and": [{"field": "price", "lt": 10.50}, '
                 '{"tags": ["a", "b"]}]}, "limit": 5, "flag": null, "exact": false, "note": "say \\"hi\\" \\\\ bye"}}]',
                 Result(calls=calls(("search", NESTED)), finish_reason="tool_calls"), "stop", id="nested"),
    pytest.param('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "search", "arguments": {"query": "weather in Par',
                 Result(calls=calls(("a", {}), ("search", {"query": "weather in Par"})), finish_reason="length"),
                 "length", id="unterminated"),
    pytest.param('[TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "UTC"}}',
                 Result(calls=calls(("get_time", {"tz": "UTC"})), finish_reason="tool_calls"), "stop", id="bare-object"),
    pytest.param("See [1] and [TOOL] notes; arrays like [1, 2] stay text.",
                 Result("See [1] and [TOOL] notes; arrays like [1, 2] stay text.", finish_reason="stop"),
                 "stop", id="plain-text"),
]


@pytest.mark.parametrize("text,expected,finish", HERMES)
def test_hermes(text, expected, finish):
    check(lambda: [tool_call_parser("hermes")], text, expected, finish)


@pytest.mark.parametrize("text,expected,finish", LLAMA3)
def test_llama3_json(text, expected, finish):
    check(lambda: [tool_call_parser("llama3_json")], text, expected, finish)


@pytest.mark.parametrize("text,expected,finish", MISTRAL)
def test_mistral(text, expected, finish):
    check(lambda: [tool_call_parser("mistral")], text, expected, finish)


def test_arguments_stream_before_the_call_ends():
    """Arguments go out while the call is still being written, not in one piece at its end."""
    from turbine.frontend.deltas import Delta
    p = tool_call_parser("hermes")
    d = p.push(Delta(0, '<tool_call>{"name": "write", "arguments": {"text": "once upon a ti'))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("write", '{"text": "once upon a ti')]
    d = p.push(Delta(0, 'me", "n": 12'))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [(None, "me")]  # 12 may still grow
    d = p.push(Delta(0, "}}</tool_call>"))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [(None, '", "n": 12}')]

"""hermes, llama3_json and mistral on recorded outputs: one-shot equals the expected calls, and
every way of streaming them equals one-shot (tests/unit/frontend/postprocess/parsers/harness.py)."""

from __future__ import annotations

import pytest

from tests.unit.frontend.postprocess.parsers.harness import case, check, params
from turbine.frontend.deltas import Delta
from turbine.frontend.postprocess.parsers import tool_call_parser

# Calls as the models write them, and what their arguments must come out as.
WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
WEATHER_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = ("get_time", {"tz": "Europe/Paris"})
TIME_JSON = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
UNICODE = ("get_weather", {"city": "Zürich", "note": "☀️ 晴れ 😀", "escaped": "é😀"})
UNICODE_JSON = ('{"name": "get_weather", "arguments": {"city": "Zürich", "note": "☀️ 晴れ 😀", '
                '"escaped": "\\u00e9\\ud83d\\ude00"}}')
NESTED = ("search", {"filter": {"and": [{"field": "price", "lt": 10.5}, {"tags": ["a", "b"]}]}, "limit": 5,
                     "flag": None, "exact": False, "note": 'say "hi" \\ bye'})
NESTED_JSON = ('{"name": "search", "arguments": {"filter": {"and": [{"field": "price", "lt": 10.50}, '
               '{"tags": ["a", "b"]}]}, "limit": 5, "flag": null, "exact": false, "note": "say \\"hi\\" \\\\ bye"}}')
CUT = ("search", {"query": "weather in Par"})
CUT_JSON = '{"name": "search", "arguments": {"query": "weather in Par'


def llama(call_json: str) -> str:
    return call_json.replace('"arguments"', '"parameters"')


CASES = {
    "hermes": [
        case(f"Let me check the weather.\n<tool_call>\n{WEATHER_JSON}\n</tool_call>", "Let me check the weather.\n",
             WEATHER, id="text-then-call"),
        case(f"<tool_call>\n{WEATHER_JSON}\n</tool_call>\n<tool_call>\n{TIME_JSON}\n</tool_call>", "\n",
             WEATHER, TIME, id="two-calls"),
        case(f"<tool_call>\n{UNICODE_JSON}\n</tool_call>", "", UNICODE, id="unicode"),
        case(f"<tool_call>\n{NESTED_JSON}\n</tool_call>", "", NESTED, id="nested"),
        case('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', "", ("search", {"q": "x"}),
             id="arguments-first"),
        case(f"Sure.\n<tool_call>\n{CUT_JSON}", "Sure.\n", CUT, finish="length", id="unterminated"),
        case('<tool_call>\n{"name": "search", "arguments": {"n": 1}}', "", ("search", {"n": 1}), id="no-end-tag"),
        case('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", ("f", {"a": 1}),
             id="arguments-as-a-json-string"),
        case('Hmm <tool_call>{"name": "get_w', 'Hmm <tool_call>{"name": "get_w', finish="length",
             id="cut-before-name"),
        case("The capital is Paris. Use <b>bold</b>, < and > freely; <tool_ and </tool_call>.",
             "The capital is Paris. Use <b>bold</b>, < and > freely; <tool_ and </tool_call>.", id="plain-text"),
        case("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", id="not-a-call"),
    ],
    "llama3_json": [
        case(f"<|python_tag|>{llama(WEATHER_JSON)}", "", WEATHER, id="python-tag"),
        case(f"{llama(WEATHER_JSON)}; {llama(TIME_JSON)}", "", WEATHER, TIME, id="two-calls"),
        case(llama(UNICODE_JSON), "", UNICODE, id="unicode"),
        case(f"\n{NESTED_JSON}", "", NESTED, id="nested"),
        case(llama(CUT_JSON), "", CUT, finish="length", id="unterminated"),
        case(f"{llama(TIME_JSON)} Done.", "Done.", TIME, id="text-after"),
        case(f"I will call {llama(TIME_JSON)}", f"I will call {llama(TIME_JSON)}", id="text-before-is-content"),
        case('{"answer": 42, "name": "Bob"} is the JSON.', '{"answer": 42, "name": "Bob"} is the JSON.',
             id="json-not-a-call"),
        case("  Hello! How can I help you today?", "  Hello! How can I help you today?", id="plain-text"),
    ],
    "mistral": [
        case(f"[TOOL_CALLS][{WEATHER_JSON}]", "", WEATHER, id="one-call"),
        case(f"Checking both.[TOOL_CALLS] [{WEATHER_JSON}, {TIME_JSON}]", "Checking both.", WEATHER, TIME,
             id="text-then-two-calls"),
        case(f"[TOOL_CALLS][{UNICODE_JSON}]", "", UNICODE, id="unicode"),
        case(f"[TOOL_CALLS][{NESTED_JSON}]", "", NESTED, id="nested"),
        case(f"[TOOL_CALLS][{TIME_JSON}, {CUT_JSON}", "", TIME, CUT, finish="length", id="unterminated"),
        case(f"[TOOL_CALLS] {TIME_JSON}", "", TIME, id="bare-object"),
        case("See [1] and [TOOL] notes; arrays like [1, 2] stay text.",
             "See [1] and [TOOL] notes; arrays like [1, 2] stay text.", id="plain-text"),
    ],
}


@pytest.mark.parametrize("name,text,expected,finish", params(CASES))
def test_recorded_outputs(name, text, expected, finish):
    check(lambda: [tool_call_parser(name)], text, expected, finish)


def test_arguments_stream_before_the_call_ends():
    """Arguments go out while the call is still being written, not in one piece at its end."""
    p = tool_call_parser("hermes")
    d = p.push(Delta(0, '<tool_call>{"name": "write", "arguments": {"text": "once upon a ti'))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("write", '{"text": "once upon a ti')]
    d = p.push(Delta(0, 'me", "n": 12'))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [(None, "me")]  # 12 may still grow
    d = p.push(Delta(0, "}}</tool_call>"))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [(None, '", "n": 12}')]

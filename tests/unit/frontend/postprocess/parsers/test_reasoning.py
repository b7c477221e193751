"""deepseek_r1 and qwen3 on recorded outputs, alone and chained before a tool-call parser:
one-shot equals the expected result, and every way of streaming them equals one-shot."""

from __future__ import annotations

import pytest

from tests.unit.frontend.postprocess.parsers.harness import Result, calls, case, check, params
from turbine.frontend.postprocess.parsers import parser_chain, reasoning_parser

CASES = {
    "deepseek_r1": [
        case("<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.", "The answer is **4**.",
             reasoning="\nThe user asks 2+2. That is 4.\n", id="tags"),
        case("Okay, 2+2=4 (<think> was in the prompt).</think>The answer is 4.", "The answer is 4.",
             reasoning="Okay, 2+2=4 (<think> was in the prompt).", id="no-opening-tag"),
        case("<think>Zürich ☀️ 晴れ 😀 </thin k></think>Antwort: ja", "Antwort: ja",
             reasoning="Zürich ☀️ 晴れ 😀 </thin k>", id="unicode"),
        case("Thinking and thinking, never closed <", reasoning="Thinking and thinking, never closed <",
             finish="length", id="unterminated"),
    ],
    "qwen3": [
        case("<think>\nhmm, greet back\n</think>\n\nHello! 😀", "Hello! 😀", reasoning="\nhmm, greet back\n", id="tags"),
        case("Hello there, no <think> here</think>.", "Hello there, no <think> here</think>.", id="no-tag-is-content"),
        case("<think>\ncut off mid-th", reasoning="\ncut off mid-th", finish="length", id="unterminated"),
        case("<thin", "<thin", id="partial-tag-only"),
    ],
}


@pytest.mark.parametrize("name,text,expected,finish", params(CASES))
def test_recorded_outputs(name, text, expected, finish):
    check(lambda: [reasoning_parser(name)], text, expected, finish)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_thinking_off_is_all_content(name):
    check(lambda: [reasoning_parser(name, enable_thinking=False)], "<think>x</think>y",
          Result("<think>x</think>y", finish_reason="stop"))


def test_reasoning_then_tool_calls_in_one_chain():
    """The reasoning parser runs first; a tool call written inside <think> stays reasoning."""
    text = ('<think>\nMaybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>? No: weather.\n</think>\n\n'
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    expected = Result("Checking.\n", '\nMaybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>? No: weather.\n',
                      calls(("get_weather", {"city": "Paris"})), "tool_calls")
    check(lambda: parser_chain("hermes", "qwen3"), text, expected)

"""deepseek_r1 and qwen3 on recorded outputs, alone and chained before a tool-call parser:
one-shot equals the expected result, and every way of streaming them equals one-shot."""

from __future__ import annotations

import pytest

from tests.unit.frontend.parsers.harness import Result, calls, check
from turbine.frontend.parsers import parser_chain, reasoning_parser

DEEPSEEK_R1 = [
    pytest.param("<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
                 Result("The answer is **4**.", "\nThe user asks 2+2. That is 4.\n", finish_reason="stop"),
                 id="tags"),
    pytest.param("Okay, 2+2=4 (<think> tags are in the prompt).</think>The answer is 4.",
                 Result("The answer is 4.", "Okay, 2+2=4 (<think> tags are in the prompt).", finish_reason="stop"),
                 id="no-opening-tag"),
    pytest.param("<think>Zürich ☀️ 晴れ 😀 </thin k></think>Antwort: ja",
                 Result("Antwort: ja", "Zürich ☀️ 晴れ 😀 </thin k>", finish_reason="stop"), id="unicode"),
    pytest.param("Thinking and thinking, never closed <", Result(reasoning="Thinking and thinking, never closed <",
                                                                finish_reason="stop"), id="unterminated"),
]

QWEN3 = [
    pytest.param("<think>\nhmm, greet back\n</think>\n\nHello! 😀", True,
                 Result("Hello! 😀", "\nhmm, greet back\n", finish_reason="stop"), id="tags"),
    pytest.param("Hello there, no <think> here</think>.", True,
                 Result("Hello there, no <think> here</think>.", finish_reason="stop"), id="no-tag-is-content"),
    pytest.param("<think>\ncut off mid-th", True, Result(reasoning="\ncut off mid-th", finish_reason="stop"),
                 id="unterminated"),
    pytest.param("<think>x</think>y", False, Result("<think>x</think>y", finish_reason="stop"), id="thinking-off"),
    pytest.param("<thin", True, Result("<thin", finish_reason="stop"), id="partial-tag-only"),
]


@pytest.mark.parametrize("text,expected", DEEPSEEK_R1)
def test_deepseek_r1(text, expected):
    check(lambda: [reasoning_parser("deepseek_r1")], text, expected)


@pytest.mark.parametrize("text,enable_thinking,expected", QWEN3)
def test_qwen3(text, enable_thinking, expected):
    check(lambda: [reasoning_parser("qwen3", enable_thinking=enable_thinking)], text, expected)


def test_reasoning_then_tool_calls_in_one_chain():
    """The reasoning parser runs first; a tool call written inside <think> stays reasoning."""
    text = ('<think>\nMaybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>? No: weather.\n</think>\n\n'
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    expected = Result("Checking.\n", '\nMaybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>? No: weather.\n',
                      calls(("get_weather", {"city": "Paris"})), "tool_calls")
    check(lambda: parser_chain("hermes", "qwen3"), text, expected)

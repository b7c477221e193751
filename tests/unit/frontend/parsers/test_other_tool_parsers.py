"""pythonic, qwen3_coder and harmony on recorded outputs: one-shot equals the expected result,
and every way of streaming them equals one-shot (harness.py)."""

from __future__ import annotations

import pytest

from tests.unit.frontend.parsers.harness import Result, calls, check
from turbine.frontend.parsers import reasoning_parser, tool_call_parser

WEATHER = {"city": "Paris", "unit": "celsius"}

PYTHONIC = [
    pytest.param('[get_weather(city="Paris", unit=\'celsius\')]',
                 Result(calls=calls(("get_weather", WEATHER)), finish_reason="tool_calls"), "stop", id="one-call"),
    pytest.param('[get_weather(city="Paris", unit="celsius"), tools.get_time(tz="Europe/Paris")]',
                 Result(calls=calls(("get_weather", WEATHER), ("tools.get_time", {"tz": "Europe/Paris"})),
                        finish_reason="tool_calls"), "stop", id="two-calls"),
    pytest.param('[search(query="café ☕ 😀", filters={"max": 3, "tags": ("a", "b"), "deep": [{"x": None}]}, '
                 'exact=True, note="a, b] c) \\"q\\""), now()] Done.',
                 Result(" Done.", calls=calls(("search", {"query": "café ☕ 😀", "filters": {"max": 3, "tags": ["a", "b"],
                                                           "deep": [{"x": None}]}, "exact": True, "note": 'a, b] c) "q"'}),
                                            ("now", {})), finish_reason="tool_calls"),
                 "stop", id="nested-unicode-text-after"),
    pytest.param('[f(a=1), g(b="unfinished',
                 Result(' g(b="unfinished', calls=calls(("f", {"a": 1})), finish_reason="length"), "length",
                 id="unterminated"),
    pytest.param("Sure: [get_time()]",
                 Result("Sure: [get_time()]", finish_reason="stop"), "stop", id="text-before-is-content"),
    pytest.param(" [1, 2, 3] are numbers; [f(x=1+2)] is not a literal call.",
                 Result(" [1, 2, 3] are numbers; [f(x=1+2)] is not a literal call.", finish_reason="stop"),
                 "stop", id="plain-text"),
    pytest.param("[f(x=1+2)]", Result("[f(x=1+2)]", finish_reason="stop"), "stop", id="no-eval"),
    pytest.param("[f(1)]", Result("[f(1)]", finish_reason="stop"), "stop", id="positional"),
]

QWEN3_CODER = [
    pytest.param("I'll look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                 Result("I'll look that up.\n", calls=calls(("get_weather", {"city": "Paris", "days": 3})),
                        finish_reason="tool_calls"), "stop", id="text-then-call"),
    pytest.param("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
                 "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                 Result("\n", calls=calls(("get_weather", {"city": "Paris"}), ("get_time", {})),
                        finish_reason="tool_calls"), "stop", id="two-calls"),
    pytest.param("<tool_call>\n<function=write_note>\n<parameter=text>\nZürich: ☀️ 晴れ 😀\nline two\n</parameter>\n"
                 "</function>\n</tool_call>",
                 Result(calls=calls(("write_note", {"text": "Zürich: ☀️ 晴れ 😀\nline two"})),
                        finish_reason="tool_calls"), "stop", id="unicode"),
    pytest.param('<tool_call>\n<function=search>\n<parameter=filter>\n{"and": [{"lt": 10.5}, {"tags": ["a"]}]}\n'
                 '</parameter>\n<parameter=exact>\nfalse\n</parameter>\n<parameter=quoted>\n"42"\n</parameter>\n'
                 '<parameter=nan>\nNaN\n</parameter>\n</function>\n</tool_call>',
                 Result(calls=calls(("search", {"filter": {"and": [{"lt": 10.5}, {"tags": ["a"]}]}, "exact": False,
                                                "quoted": "42", "nan": "NaN"})), finish_reason="tool_calls"),
                 "stop", id="nested-json-values"),
    pytest.param("<tool_call>\n<function=search>\n<parameter=n>\n1\n</parameter>\n<parameter=query>\nweather in Par",
                 Result(calls=calls(("search", {"n": 1})), finish_reason="length"), "length", id="unterminated"),
    pytest.param("Use <b>tags</b> and <tool_ freely; <function=x> alone is text.",
                 Result("Use <b>tags</b> and <tool_ freely; <function=x> alone is text.", finish_reason="stop"),
                 "stop", id="plain-text"),
    pytest.param("<tool_call>\nnot xml</tool_call>",
                 Result("<tool_call>\nnot xml</tool_call>", finish_reason="stop"), "stop", id="not-a-call"),
]

HARMONY = [
    pytest.param("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|><|start|>assistant"
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city": "Paris", "unit": "celsius"}<|call|>',
                 Result(reasoning="User wants weather. Call the tool.", calls=calls(("get_weather", WEATHER)),
                        finish_reason="tool_calls"), "stop", id="reasoning-then-call"),
    pytest.param("<|channel|>analysis<|message|>Two tools.<|end|>"
                 '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city":"Paris",'
                 '"unit":"celsius"}<|call|>'
                 "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
                 Result(reasoning="Two tools.", calls=calls(("get_weather", WEATHER), ("get_time", {})),
                        finish_reason="tool_calls"), "stop", id="two-calls"),
    pytest.param("<|channel|>analysis<|message|>Think: ünïcödé 😀<|end|><|start|>assistant<|channel|>final"
                 "<|message|>Zürich: ☀️ 晴れ<|return|>",
                 Result("Zürich: ☀️ 晴れ", "Think: ünïcödé 😀", finish_reason="stop"), "stop", id="reasoning-and-final"),
    pytest.param("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.search <|constrain|>json<|message|>{"filter": {"and": [{"lt": 10.50}, {"tags": ["a"]}]}, '
                 '"q": "\\u00e9"}<|call|>',
                 Result("Let me check.", calls=calls(("search", {"filter": {"and": [{"lt": 10.5}, {"tags": ["a"]}]},
                                                                 "q": "é"})), finish_reason="tool_calls"),
                 "stop", id="preamble-then-nested"),
    pytest.param("<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>commentary to=functions.search"
                 ' <|constrain|>json<|message|>{"query": "weather in Par',
                 Result(reasoning="ok", calls=calls(("search", {"query": "weather in Par"})), finish_reason="length"),
                 "length", id="unterminated"),
    pytest.param("<|channel|>analysis<|message|>still thinking, cut o",
                 Result(reasoning="still thinking, cut o", finish_reason="length"), "length", id="cut-in-analysis"),
    pytest.param("Plain text with <| and |> but no channels.",
                 Result("Plain text with <| and |> but no channels.", finish_reason="stop"), "stop", id="plain-text"),
]


@pytest.mark.parametrize("text,expected,finish", PYTHONIC)
def test_pythonic(text, expected, finish):
    check(lambda: [tool_call_parser("pythonic")], text, expected, finish)


@pytest.mark.parametrize("text,expected,finish", QWEN3_CODER)
def test_qwen3_coder(text, expected, finish):
    check(lambda: [tool_call_parser("qwen3_coder")], text, expected, finish)


@pytest.mark.parametrize("text,expected,finish", HARMONY)
def test_harmony(text, expected, finish):
    check(lambda: [tool_call_parser("harmony")], text, expected, finish)
    check(lambda: [reasoning_parser("harmony")], text, expected, finish)

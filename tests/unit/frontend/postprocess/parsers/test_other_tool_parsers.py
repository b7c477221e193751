"""pythonic, qwen3_coder and harmony on recorded outputs: one-shot equals the expected result,
and every way of streaming them equals one-shot (harness.py)."""

from __future__ import annotations

import pytest

from tests.unit.frontend.postprocess.parsers.harness import case, check, params
from turbine.frontend.postprocess.parsers import reasoning_parser, tool_call_parser

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {})
NESTED = {"filter": {"and": [{"lt": 10.5}, {"tags": ["a"]}]}, "q": "é"}
CUT = ("search", {"query": "weather in Par"})


def xml_call(name: str, **params: str) -> str:
    """A call in Qwen3-Coder's XML, laid out as the model writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def harmony_call(header: str, args: str) -> str:
    return f"<|start|>assistant{header}<|message|>{args}<|call|>"


CASES = {
    "pythonic": [
        case('[get_weather(city="Paris", unit=\'celsius\')]', "", WEATHER, id="one-call"),
        case('[get_weather(city="Paris", unit="celsius"), tools.get_time()]', "", WEATHER, ("tools.get_time", {}),
             id="two-calls"),
        case('[search(query="café ☕ 😀", filters={"max": 3, "tags": ("a", "b"), "deep": [{"x": None}]}, '
             'exact=True, note="a, b] c) \\"q\\""), get_time()] Done.', " Done.",
             ("search", {"query": "café ☕ 😀", "filters": {"max": 3, "tags": ["a", "b"], "deep": [{"x": None}]},
                         "exact": True, "note": 'a, b] c) "q"'}), TIME, id="nested-unicode-text-after"),
        case('[get_time(), search(query="unfinished', ' search(query="unfinished', TIME, finish="length",
             id="unterminated"),
        case("Sure: [get_time()]", "Sure: [get_time()]", id="text-before-is-content"),
        case(" [1, 2, 3] are numbers.", " [1, 2, 3] are numbers.", id="plain-text"),
        case("[f(x=__import__('os'))]", "[f(x=__import__('os'))]", id="never-evaluated"),
        case("[f(x=1+2)]", "[f(x=1+2)]", id="literals-only"),
        case("[f(1)]", "[f(1)]", id="positional"),
    ],
    "qwen3_coder": [
        case("I'll look that up.\n" + xml_call("get_weather", city="Paris", days="3"), "I'll look that up.\n",
             ("get_weather", {"city": "Paris", "days": 3}), id="text-then-call"),
        case(xml_call("get_weather", city="Paris", unit="celsius") + "\n" + xml_call("get_time"), "\n", WEATHER, TIME,
             id="two-calls"),
        case(xml_call("note", text="Zürich: ☀️ 晴れ 😀\nline two"), "", ("note", {"text": "Zürich: ☀️ 晴れ 😀\nline two"}),
             id="unicode"),
        case(xml_call("search", filter='{"and": [{"lt": 10.5}, {"tags": ["a"]}]}', exact="false", quoted='"42"',
                      nan="NaN"), "",
             ("search", {"filter": NESTED["filter"], "exact": False, "quoted": "42", "nan": "NaN"}),
             id="json-typed-values"),
        case(xml_call("search", n="1")[:-len("</function>\n</tool_call>")] + "<parameter=query>\nweather in Par", "",
             ("search", {"n": 1}), finish="length", id="unterminated"),
        case("Use <b>tags</b> and <tool_ freely; <function=x> alone is text.",
             "Use <b>tags</b> and <tool_ freely; <function=x> alone is text.", id="plain-text"),
        case("<tool_call>\nnot xml</tool_call>", "<tool_call>\nnot xml</tool_call>", id="not-a-call"),
    ],
    "harmony": [
        case("<|channel|>analysis<|message|>User wants weather.<|end|>"
             + harmony_call("<|channel|>commentary to=functions.get_weather <|constrain|>json",
                            '{"city": "Paris", "unit": "celsius"}'), "", WEATHER, reasoning="User wants weather.",
             id="reasoning-then-call"),
        case("<|channel|>analysis<|message|>Two tools.<|end|>"
             + harmony_call("<|channel|>commentary to=functions.get_weather json", '{"city":"Paris","unit":"celsius"}')
             + harmony_call(" to=functions.get_time<|channel|>commentary json", "{}"), "", WEATHER, TIME,
             reasoning="Two tools.", id="two-calls-recipient-either-side"),
        case("<|channel|>analysis<|message|>Think: ünïcödé 😀<|end|><|start|>assistant<|channel|>final"
             "<|message|>Zürich: ☀️ 晴れ<|return|>", "Zürich: ☀️ 晴れ", reasoning="Think: ünïcödé 😀",
             id="reasoning-and-final"),
        case("<|channel|>commentary<|message|>Let me check.<|end|>"
             + harmony_call("<|channel|>commentary to=functions.search <|constrain|>json",
                            '{"filter": {"and": [{"lt": 10.50}, {"tags": ["a"]}]}, "q": "\\u00e9"}'),
             "Let me check.", ("search", NESTED), id="preamble-then-nested"),
        case("<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>commentary to=functions.search"
             ' <|constrain|>json<|message|>{"query": "weather in Par', "", CUT, reasoning="ok", finish="length",
             id="unterminated"),
        case("<|channel|>analysis<|message|>still thinking, cut o", reasoning="still thinking, cut o",
             finish="length", id="cut-in-analysis"),
        case("Plain text with <| and |> but no channels.", "Plain text with <| and |> but no channels.",
             id="plain-text"),
    ],
}


@pytest.mark.parametrize("name,text,expected,finish", params(CASES))
def test_recorded_outputs(name, text, expected, finish):
    check(lambda: [tool_call_parser(name)], text, expected, finish)
    if name == "harmony":  # the same parser under the reasoning name
        check(lambda: [reasoning_parser(name)], text, expected, finish)

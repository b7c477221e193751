"""The registry, finish reasons, the import rule, and that the harness catches broken parsers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.frontend.postprocess.parsers.harness import Result, assemble, calls, check, run
from turbine.frontend.deltas import Delta, ToolCallDelta
from turbine.frontend.postprocess.parsers import (REASONING_PARSERS, TOOL_CALL_PARSERS, parser_chain, reasoning_parser,
                                      tool_call_parser)
from turbine.frontend.postprocess.parsers.harmony import HarmonyParser
from turbine.frontend.postprocess.parsers.json_calls import HermesParser
from turbine.protocol.discovery import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def test_registry_names_and_unknown_names():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "harmony"}
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "harmony"}
    # the names workers accept for their model card (turbine.protocol, no frontend import)
    assert sorted(TOOL_CALL_PARSERS) == list(TOOL_CALL_PARSER_NAMES)
    assert sorted(REASONING_PARSERS) == list(REASONING_PARSER_NAMES)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; known: harmony, hermes, llama3_json"):
        tool_call_parser("nope")
    with pytest.raises(ValueError, match="known: deepseek_r1, harmony, qwen3"):
        reasoning_parser("hermes")
    assert tool_call_parser("hermes") is not tool_call_parser("hermes")  # one per choice


def test_parser_chain():
    assert [type(p).__name__ for p in parser_chain("hermes", "deepseek_r1")] == ["DeepSeekR1Parser", "HermesParser"]
    assert [type(p) for p in parser_chain("harmony", "harmony")] == [HarmonyParser]
    assert parser_chain() == []


@pytest.mark.parametrize("finish,expected", [("stop", "tool_calls"), ("length", "length"), ("abort", "abort")])
def test_finish_reason_with_calls(finish, expected):
    """A model that stopped by itself after calling tools finishes with "tool_calls"."""
    assert run(lambda: [tool_call_parser("hermes")], [CALL], finish).finish_reason == expected
    assert run(lambda: [tool_call_parser("hermes")], [CALL], finish, separate_finish=True).finish_reason == expected


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_finish_reason_without_calls(name):
    assert run(lambda: [tool_call_parser(name)], ["Just text."], "stop") == Result("Just text.", finish_reason="stop")


def test_other_parts_pass_through():
    """A parser only reads text: reasoning, earlier tool-call fragments and logprobs pass."""
    earlier = ToolCallDelta(0, "call_x", "g", "{}")
    d = tool_call_parser("hermes").push(Delta(0, "hi", reasoning="r", tool_calls=[earlier], logprobs=[]))
    assert (d.text, d.reasoning, d.tool_calls) == ("hi", "r", [earlier])


def test_never_imports_torch_or_vllm():
    code = ("import sys, turbine.frontend.postprocess.parsers; "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


class _LosesHeldText(HermesParser):
    def finish(self, delta):
        self.buf = ""  # forgets what it held back
        return super().finish(delta)


class _ForgetsBetweenDeltas(HermesParser):
    def push(self, delta):
        self.buf = ""  # right on one whole output, wrong on a stream
        return super().push(delta)


def test_the_harness_catches_broken_parsers():
    expected = Result("A <tool", finish_reason="stop")
    check(lambda: [HermesParser()], "A <tool", expected)
    with pytest.raises(AssertionError):
        check(lambda: [_LosesHeldText()], "A <tool", expected)
    good = Result(calls=calls(("f", {"a": 1})), finish_reason="tool_calls")
    assert run(lambda: [_ForgetsBetweenDeltas()], [CALL]) == good
    with pytest.raises(AssertionError, match="split at"):
        check(lambda: [_ForgetsBetweenDeltas()], CALL, good)
    with pytest.raises(AssertionError):  # a wrong expectation fails
        check(lambda: [HermesParser()], CALL, Result(calls=calls(("f", {"a": 2})), finish_reason="tool_calls"))
    with pytest.raises(AssertionError):  # a call named twice fails the shape check
        assemble([Delta(0, tool_calls=[ToolCallDelta(0, "call_" + "0" * 24, "f"),
                                        ToolCallDelta(0, "call_" + "1" * 24, "f")], finish_reason="stop")])

"""Output parsers for the postprocess stage's parser chain: reasoning parsers move text into
`Delta.reasoning`, tool-call parsers into `Delta.tool_calls` fragments. See README.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from turbine.frontend.postprocess.parsers.base import ParserBase
from turbine.frontend.postprocess.parsers.harmony import HarmonyParser
from turbine.frontend.postprocess.parsers.json_calls import HermesParser, Llama3JsonParser, MistralParser
from turbine.frontend.postprocess.parsers.pythonic import PythonicParser
from turbine.frontend.postprocess.parsers.qwen3_coder import Qwen3CoderParser
from turbine.frontend.postprocess.parsers.reasoning import DeepSeekR1Parser, Qwen3Parser

if TYPE_CHECKING:
    from turbine.frontend.deltas import OutputParser

TOOL_CALL_PARSERS: dict[str, Callable[[], ParserBase]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "harmony": HarmonyParser,
}

# Each takes enable_thinking (the request's chat_template_kwargs; on by default).
REASONING_PARSERS: dict[str, Callable[..., ParserBase]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
    "harmony": HarmonyParser,
}


def tool_call_parser(name: str) -> OutputParser:
    """A new tool-call parser (one per choice). ValueError names the known ones."""
    return _known(TOOL_CALL_PARSERS, name, "tool-call")()


def reasoning_parser(name: str, enable_thinking: bool = True) -> OutputParser:
    """A new reasoning parser (one per choice). ValueError names the known ones."""
    return _known(REASONING_PARSERS, name, "reasoning")(enable_thinking=enable_thinking)


def parser_chain(tool_call: str | None = None, reasoning: str | None = None,
                 enable_thinking: bool = True) -> list[OutputParser]:
    """One choice's chain: the reasoning parser first, so that the tool-call parser sees only
    content. `harmony` reads both from one stream, so it stands once when named for both."""
    chain = [reasoning_parser(reasoning, enable_thinking)] if reasoning else []
    if tool_call and not (tool_call == reasoning == "harmony"):
        chain.append(tool_call_parser(tool_call))
    return chain


def _known(table: dict[str, Callable[..., ParserBase]], name: str, kind: str) -> Callable[..., ParserBase]:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} parser {name!r}; known: {', '.join(sorted(table))}") from None


__all__ = ["REASONING_PARSERS", "TOOL_CALL_PARSERS", "parser_chain", "reasoning_parser", "tool_call_parser"]

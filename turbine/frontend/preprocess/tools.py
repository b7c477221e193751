"""Tool calling and reasoning for one chat request: the `tools` / `tool_choice` /
`parallel_tool_calls` checks, the constraint that forces a call (`required` or a named
function, through the engine's structured outputs), and the output-parser chain that the
postprocess stage runs per choice (the model card's reasoning parser, and its tool-call parser
for `auto`). Follows vLLM's OpenAI server on every choice it makes (noted where)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turbine.frontend.errors import RequestError
from turbine.frontend.postprocess.parsers import parser_chain
from turbine.frontend.postprocess.parsers.forced_calls import FirstCallOnly, NamedCallParser, RequiredCallsParser
from turbine.protocol.discovery import ModelCard
from turbine.protocol.generate import StructuredOutputs

# Parsers whose markers are special tokens: the detokenizer must keep special tokens for them.
SPECIAL_TOKEN_PARSERS = frozenset({"harmony", "mistral", "llama3_json"})


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What a chat request's tools and reasoning settings mean for its generation and output."""

    parsers: Callable[[], list] = list  # one choice's parser chain
    structured_outputs: StructuredOutputs | None = None  # the constraint forcing a call
    keep_special_tokens: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)  # as the template gets them


def plan(req, card: ModelCard, template_handles_tool_calls: bool) -> OutputPlan:
    """Checks the request's tool fields (RequestError naming the field) and plans its output.
    `req` is a ChatCompletionRequest."""
    tools = check_tools(req.tools)
    choice = check_tool_choice(req.tool_choice, tools)
    if choice is None:  # OpenAI's default: auto when tools are given, else none
        choice = "auto" if tools else "none"
    if choice == "auto" and tools and card.tool_call_parser is None:
        # vLLM answers the same: without a parser a call would come back as plain text.
        raise RequestError(f"tool_choice 'auto' needs a tool-call parser, and the model {card.name!r} has none "
                           "(its workers' --dyn-tool-call-parser); use tool_choice 'required', a named function "
                           "or 'none'", param="tool_choice")
    single = req.parallel_tool_calls is False
    kwargs = req.chat_template_kwargs or {}
    thinking = kwargs.get("enable_thinking", True) is not False
    reasoning = card.reasoning_parser

    structured = None
    tool_parser = None
    if isinstance(choice, dict):  # a named function: the output is that call's arguments
        name = choice["function"]["name"]
        structured = StructuredOutputs(json=json.dumps(_parameters(tools[name])))
        tool_parser = lambda: NamedCallParser(name)  # noqa: E731
    elif choice == "required":
        structured = StructuredOutputs(json=json.dumps(required_schema(list(tools.values()), single)))
        tool_parser = RequiredCallsParser
    elif choice == "auto" and tools:
        tool_parser = card.tool_call_parser

    def chain() -> list:
        if isinstance(tool_parser, str) or tool_parser is None:
            parsers = parser_chain(tool_parser, reasoning, thinking)
        else:  # a forced call: the whole output is JSON, so no reasoning parser before it
            parsers = [tool_parser()]
        if single and tool_parser is not None:
            parsers.append(FirstCallOnly())
        return parsers

    names = {reasoning, tool_parser if isinstance(tool_parser, str) else None}
    return OutputPlan(
        parsers=chain if (reasoning or tool_parser) else list,
        structured_outputs=structured,
        keep_special_tokens=bool(names & SPECIAL_TOKEN_PARSERS),
        messages=req.messages if template_handles_tool_calls else [_inline_tool_calls(m) for m in req.messages],
    )


# -- request checks --------------------------------------------------------------------
def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The tools by name; a malformed one is a 400 naming it."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        _require(isinstance(tool, dict) and tool.get("type", "function") == "function", where,
                 "must be an object of type 'function'")
        fn = tool.get("function")
        _require(isinstance(fn, dict), f"{where}.function", "is required and must be an object")
        name = fn.get("name")
        _require(isinstance(name, str) and bool(name), f"{where}.function.name", "is required and must be a string")
        _require(name not in by_name, f"{where}.function.name", f"{name!r} is named twice")
        params = fn.get("parameters")
        _require(params is None or isinstance(params, dict), f"{where}.function.parameters",
                 "must be a JSON schema object")
        _require(fn.get("description") is None or isinstance(fn.get("description"), str),
                 f"{where}.function.description", "must be a string")
        by_name[name] = fn
    return by_name


def check_tool_choice(choice: str | dict[str, Any] | None, tools: dict[str, dict[str, Any]]) -> str | dict | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        _require(choice in ("none", "auto", "required"), "tool_choice",
                 f"{choice!r}: use 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}")
        _require(choice != "required" or bool(tools), "tool_choice", "'required' needs tools")
        return choice
    fn = choice.get("function")
    _require(choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str),
             "tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
    _require(bool(tools), "tool_choice", "a named function needs tools")
    _require(fn["name"] in tools, "tool_choice", f"names {fn['name']!r}, which is not among the tools")
    return choice


def _require(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise RequestError(f"{param}: {message}", param=param)


# -- the forced call's constraint --------------------------------------------------------
def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def required_schema(fns: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """The output of `tool_choice: required`, as vLLM builds it: a list of one or more
    {"name", "parameters"} objects, each one of the tools (at most one with `single`)."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": _parameters(fn)},
         "required": ["name", "parameters"]} for fn in fns]}}
    if single:
        schema["maxItems"] = 1
    defs = {k: v for fn in fns for k, v in (_parameters(fn).get("$defs") or {}).items()}
    if defs:  # a tool's $ref points at the document root's $defs
        schema["$defs"] = defs
    return schema


# -- messages for templates that know nothing of tool calls -------------------------------
def _inline_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls written into its content the way hermes-style models
    write them, for a template that does not render `tool_calls` (SmolLM2's would fail on the
    message's null content)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    parts = [message["content"]] if isinstance(message.get("content"), str) and message["content"] else []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise RequestError("messages: a tool call is {'id', 'type': 'function', 'function': {'name', "
                               "'arguments'}}", param="messages")
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, RecursionError):  # RecursionError: nested too deeply (found by fuzzing: was a 500)
            pass  # kept as the text it is
        parts.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>")
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": "\n".join(parts)}

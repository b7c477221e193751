"""The parsers of forced tool calls (`tool_choice` naming a function, or `required`; the request's
tools in turbine/frontend/preprocess/tools.py choose them): the engine was constrained to the
call's JSON, so these turn that JSON into tool-call deltas as it streams. And `parallel_tool_calls:
false`'s filter."""

from __future__ import annotations

from turbine.frontend.deltas import Delta
from turbine.frontend.postprocess.parsers.base import ParserBase
from turbine.frontend.postprocess.parsers.json_calls import JsonSequence


class NamedCallParser(ParserBase):
    """`tool_choice` naming a function: the whole output is that call's arguments (JSON the
    engine was constrained to), sent as it comes. Finishes with "stop", as OpenAI does."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.index: int | None = None

    def _step(self, final: bool) -> bool:
        if self.buf or final:
            if self.index is None:
                self.index = self._start_call(self.name)
            self._call_args(self.index, self.buf)
            self.buf = ""
        return False

    def finish(self, delta: Delta) -> Delta:
        reason = delta.finish_reason
        out = super().finish(delta)
        out.finish_reason = reason
        return out


class RequiredCallsParser(JsonSequence):
    """`tool_choice: required`: the output is a JSON list of {"name", "parameters"} objects."""

    SEPARATOR, END = ",", "]"

    def _opening(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith("["):
            self.buf, self.state = s[1:], "item"
        elif not s and not final:
            return False
        else:
            self.state = "text"
        return True

    def _need_args(self) -> bool:
        return True


class FirstCallOnly:
    """`parallel_tool_calls: false`: only the first call goes out (vLLM keeps the first too)."""

    def push(self, delta: Delta) -> Delta:
        if delta.tool_calls:
            delta.tool_calls = [c for c in delta.tool_calls if c.index == 0] or None
        return delta

    def finish(self, delta: Delta) -> Delta:
        return delta

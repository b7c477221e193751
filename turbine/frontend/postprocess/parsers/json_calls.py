"""Tool-call parsers for models that write each call as a JSON object
{"name": ..., "arguments"|"parameters": {...}}: hermes, llama3_json, mistral."""

from __future__ import annotations

from turbine.frontend.deltas import Delta
from turbine.frontend.postprocess.parsers.base import JsonCall, ParserBase


class HermesParser(ParserBase):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them (Hermes,
    Qwen2.5, Qwen3). Text before, between and after the calls stays content; a block that is
    not a call is given back as text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.call: JsonCall | None = None

    def push(self, delta: Delta) -> Delta:
        # Fast paths (the parser runs on every token): text that cannot touch a marker ("<" is
        # in neither it nor the held tail) is content outside a call, or grows the call inside one.
        text = delta.text
        if text and "<" not in text and "<" not in self.buf[-len(self.CLOSE):]:
            if self.call is None and not self.buf:
                return delta
            if self.call is not None:
                delta.text, self._out = "", delta
                if delta.tool_calls is not None:
                    delta.tool_calls = list(delta.tool_calls) or None
                self.buf += text
                self.call.update(self.buf)
                return delta
        return super().push(delta)

    def _step(self, final: bool) -> bool:
        if self.call is None:
            text, marker = self._cut((self.OPEN,), final)
            self._text(text)
            if marker is None:
                return False
            self.call = JsonCall(self)
            return True
        body, marker = self._cut((self.CLOSE,), final)
        if marker is None and not final:
            self.buf = body + self.buf  # keep the whole call until it closes
            self.call.update(body)
            return False
        if not self.call.close(body):
            self._text(self.OPEN + body + (marker or ""))
        self.call = None
        return marker is not None


class JsonSequence(ParserBase):
    """Calls as JSON objects one after another with a separator between them; a subclass says
    how the sequence opens (`_opening`) and what separates and ends it."""

    SEPARATOR: str
    END: str | None  # closes the sequence (the rest is content), or None
    TAG_IN_TEXT: str | None = None  # opens a sequence again after content, or None

    def __init__(self) -> None:
        super().__init__()
        self.state = "open"  # open -> call -> after -> (item -> call -> after)* -> text
        self.call: JsonCall | None = None

    def _opening(self, final: bool) -> bool:
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        if self.state == "open":
            return self._opening(final)
        if self.state == "text":
            if not self.TAG_IN_TEXT:
                self._text(self.buf)
                self.buf = ""
                return False
            text, marker = self._cut((self.TAG_IN_TEXT,), final)
            self._text(text)
            if marker is None:
                return False
            self.state = "open"
            return True
        if self.state == "call":
            assert self.call is not None
            end = self.call.feed(self.buf)
            if end is None and not final:
                return False
            raw = self.buf if end is None else self.buf[:end]
            self.buf = self.buf[len(raw):]
            self.state = "after" if self.call.close(raw) and end is not None else "text"
            if not self.call.started:
                self._text(raw)
            self.call = None
            return True
        # between items: skip whitespace, then a separator, an end, or a call ("item" only)
        s = self.buf.lstrip()
        if not s:
            self.buf = "" if final else self.buf
            return False
        if self.state == "item" and s[0] == "{":
            self._start(s)
        elif self.state == "after" and s[0] == self.SEPARATOR:
            self.buf, self.state = s[1:], "item"
        elif self.END is not None and s[0] == self.END:
            self.buf, self.state = s[1:], "text"
        else:
            self.buf, self.state = s, "text"
        return True

    def _start(self, s: str) -> None:
        self.buf, self.state, self.call = s, "call", JsonCall(self, self._need_args())

    def _need_args(self) -> bool:
        return False


class Llama3JsonParser(JsonSequence):
    """Llama 3.1/3.2 JSON tool calls: the output starts (past whitespace and an optional
    `<|python_tag|>`) with `{"name": ..., "parameters": {...}}`, several separated by ";".
    An output that starts otherwise is all content; so is a leading object without a name and
    arguments, and whatever follows the calls."""

    SEPARATOR, END = ";", None
    TAG = "<|python_tag|>"

    def _opening(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith(self.TAG):
            self.buf = s[len(self.TAG):]
        elif s.startswith("{"):
            self._start(s)
        elif self._waiting_for((self.TAG, "{"), final):
            return False
        else:
            self.state = "text"
        return True

    def _need_args(self) -> bool:
        return True  # a bare JSON answer is not a call


class MistralParser(JsonSequence):
    """Mistral: `[TOOL_CALLS]` then a JSON list of calls (or a single call object). Text before
    the marker stays content, and the marker may come again after."""

    SEPARATOR, END = ",", "]"
    TAG = TAG_IN_TEXT = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"

    def _opening(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith("["):
            self.buf, self.state = s[1:], "item"
        elif s.startswith("{"):
            self._start(s)
        elif not s and not final:
            return False
        else:
            self.state = "text"
        return True

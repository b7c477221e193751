"""What every output parser shares: the push/finish plumbing over one choice's Deltas, text held
back while it may be the start of a marker, tool-call ids, and JSON arguments streamed as
fragments whose concatenation is exactly the call's final arguments text."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets

from partial_json_parser import Allow, loads as partial_loads

from turbine.frontend.deltas import Delta, ToolCallDelta

log = logging.getLogger(__name__)

# While a call streams, strings may be cut but numbers and true/false/null count only when
# whole: a cut "12" could still become "123", a cut string is a prefix of the final one.
_STREAMABLE = Allow.STR | Allow.OBJ | Allow.ARR
_WHOLE_STRINGS = Allow.OBJ | Allow.ARR
_decoder = json.JSONDecoder()
# A whole "name" string in a call object's text (before it, the call cannot start).
_NAMED = re.compile(r'"name"\s*:\s*"(?:[^"\\]|\\.)*"')


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def dumps(value: object) -> str:
    """The one JSON text of a value that every parser emits as arguments."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def loads_strict(text: str) -> object:
    """json.loads without NaN/Infinity (they have no JSON text to emit)."""
    return json.loads(text, parse_constant=_no_constant)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def held_from(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that could still grow into one of `markers` begins
    (len(text) when none could)."""
    firsts = {m[0] for m in markers}
    longest = max(map(len, markers)) - 1
    for i in range(max(0, len(text) - longest), len(text)):
        if text[i] in firsts and any(m.startswith(text[i:]) for m in markers):
            return i
    return len(text)


def json_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` ends, once it is complete."""
    try:
        return _decoder.raw_decode(text)[1]
    except ValueError:
        return None


class ParserBase:
    """OutputParser plumbing. A subclass keeps text not yet placed in `self.buf` and implements
    `_step(final)`: place what it can (with `_text`, `_reasoning`, `_start_call`, `_call_args`)
    and return True to be called again, False when it needs more text. With `final` (the choice
    has ended) it must place or drop everything. It only ever reads `delta.text`: reasoning and
    tool calls placed by a parser before it in the chain pass through untouched."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0  # tool calls started so far; call indexes are 0, 1, ...
        self._out = Delta(0)

    def push(self, delta: Delta) -> Delta:
        # The delta is this parser's to change (each one passes the chain once): no copy per token.
        text, delta.text = delta.text, ""
        if delta.tool_calls is not None:
            delta.tool_calls = list(delta.tool_calls) or None
        self._out = delta
        if text:
            self.buf += text
            while self._step(False):
                pass
        return self._out

    def finish(self, delta: Delta) -> Delta:
        self._out = dataclasses.replace(delta, tool_calls=list(delta.tool_calls or ()) or None)
        while self._step(True):
            pass
        self.buf = ""
        if self.calls and self._out.finish_reason == "stop":
            self._out.finish_reason = "tool_calls"
        return self._out

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    # -- reading the buffer --------------------------------------------------------------
    def _cut(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None]:
        """Takes the text before the first of `markers` and that marker off the buffer. Without
        one, takes all but a tail that may still become one (all of it when `final`)."""
        buf, found = self.buf, None
        for m in markers:
            i = buf.find(m)
            if i >= 0 and (found is None or i < found[0]):
                found = (i, m)
        if found is not None:
            i, m = found
            self.buf = buf[i + len(m):]
            return buf[:i], m
        k = len(buf) if final else held_from(buf, markers)
        self.buf = buf[k:]
        return buf[:k], None

    def _waiting_for(self, markers: tuple[str, ...], final: bool) -> bool:
        """Whether the buffer (past leading whitespace) may still grow into one of `markers`:
        then hold it (never when `final`)."""
        s = self.buf.lstrip()
        return not final and any(m.startswith(s) for m in markers)

    # -- writing the output delta --------------------------------------------------------
    def _text(self, s: str) -> None:
        self._out.text += s

    def _reasoning(self, s: str) -> None:
        self._out.reasoning += s

    def _start_call(self, name: str) -> int:
        index, self.calls = self.calls, self.calls + 1
        self._add(ToolCallDelta(index, new_call_id(), name))
        return index

    def _call_args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == index:
            calls[-1].arguments += fragment  # one fragment per call per delta
        else:
            self._add(ToolCallDelta(index, arguments=fragment))

    def _add(self, fragment: ToolCallDelta) -> None:
        if self._out.tool_calls is None:
            self._out.tool_calls = []
        self._out.tool_calls.append(fragment)


class ArgsStream:
    """One call's arguments as JSON text fragments. While the call is incomplete it sends the
    part of its partial parse's JSON text that can no longer change; at the end, the rest of the
    final text. The fragments concatenate to exactly that final text."""

    def __init__(self, parser: ParserBase, index: int):
        self.parser, self.index, self.sent = parser, index, ""

    def partial(self, value: object) -> None:
        """`value`: a partial parse (strings may be cut, atoms whole). Only objects stream."""
        if not isinstance(value, dict):
            return
        # Closing quotes and brackets were added by the partial parse; drop them, and a high
        # surrogate whose pair may be still to come.
        text = dumps(value).rstrip('"]}')
        if text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]
        if len(text) > len(self.sent) and text.startswith(self.sent):
            self.parser._call_args(self.index, text[len(self.sent):])
            self.sent = text

    def final(self, text: str) -> None:
        if not text.startswith(self.sent):  # only for malformed JSON (e.g. a repeated key)
            log.warning("tool call %d: streamed arguments %r are not a prefix of %r", self.index, self.sent, text)
            return
        self.parser._call_args(self.index, text[len(self.sent):])
        self.sent = text


def partial_json(text: str, allow: Allow = _STREAMABLE) -> object:
    """The partial parse of JSON text (None when there is nothing to parse yet)."""
    try:
        return partial_loads(text, allow)
    except Exception:  # the library raises its own errors, ValueError and IndexError
        return None


def json_value(text: str) -> object:
    """The value of JSON text; of cut-off text, the most of it that parses (None if nothing)."""
    try:
        return loads_strict(text)
    except ValueError:
        return partial_json(text, Allow.ALL)


def arguments_text(value: object) -> str:
    """A call's arguments as the JSON text clients get: an object's JSON, a string as it is
    (some models write the arguments as a JSON string), {} when missing."""
    if value is None:
        return "{}"
    return value if isinstance(value, str) else dumps(value)


class JsonCall:
    """One tool call written as a JSON object {"name": ..., "arguments"|"parameters": ...}, in
    any key order, followed as its text grows. The call starts (id and name go out) once its
    name is whole and, with `need_args`, its arguments key has appeared; its arguments stream
    while they are an object."""

    def __init__(self, parser: ParserBase, need_args: bool = False):
        self.parser, self.need_args = parser, need_args
        self.args: ArgsStream | None = None
        self._seen = 0
        self._next_parse = 0  # text length at which the partial parse runs again

    @property
    def started(self) -> bool:
        return self.args is not None

    def feed(self, raw: str) -> int | None:
        """Follows the object's text so far (it starts at "{"); returns where the object ends
        once it is complete, without placing anything for it (then `close` it)."""
        if "}" in raw[self._seen:]:
            end = json_end(raw)
            if end is not None:
                return end
        self._seen = len(raw)
        self.update(raw)
        return None

    def update(self, raw: str, force: bool = False) -> None:
        # Re-parsing the whole call on every delta is quadratic in its length and costs more than
        # the rest of the request's path: once the call has started, parse again only when its
        # text has doubled (plus 64 characters). The fragments still concatenate
        # to the same text; they come in fewer, larger pieces.
        if not force:
            if len(raw) < self._next_parse or (self.args is None and not _NAMED.search(raw)):
                return
            if self.args is not None:
                self._next_parse = 2 * len(raw) + 64
        obj = partial_json(raw)
        if not isinstance(obj, dict):
            return
        if self.args is None:
            if self.need_args and "arguments" not in obj and "parameters" not in obj:
                return
            whole = partial_json(raw, _WHOLE_STRINGS)
            name = whole.get("name") if isinstance(whole, dict) else None
            if not isinstance(name, str):
                return
            self.args = ArgsStream(self.parser, self.parser._start_call(name))
        self.args.partial(_arguments_of(obj))

    def close(self, raw: str) -> bool:
        """Ends the call with all its text (complete, or cut off by the end of the output).
        False when it never became a call: nothing was placed, the caller keeps the text."""
        if self.args is None:
            self.update(raw, force=True)
        if self.args is None:
            return False
        obj = json_value(raw)
        self.args.final(arguments_text(_arguments_of(obj) if isinstance(obj, dict) else None))
        return True


def _arguments_of(obj: dict) -> object:
    return obj["arguments"] if "arguments" in obj else obj.get("parameters")

"""The qwen3_coder tool-call parser (Qwen3-Coder's XML):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value (one newline on each side dropped) is typed by trying JSON, else it is a
string. Arguments stream a parameter at a time: `{"city": "Paris"`, `, "days": 3`, `}`."""

from __future__ import annotations

import re

from turbine.frontend.postprocess.parsers.base import ParserBase, dumps, loads_strict

_FUNCTION = re.compile(r"<function=([^>]*)>")
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ParserBase):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    TAGS = ("<function=", "<parameter=", "</function>", CLOSE)

    def __init__(self) -> None:
        super().__init__()
        self.in_call = False
        self.index: int | None = None  # of the call being read, once its name is known
        self.params = 0
        self.closed = False  # its arguments' "}" went out

    def _step(self, final: bool) -> bool:
        if not self.in_call:
            text, marker = self._cut((self.OPEN,), final)
            self._text(text)
            if marker is None:
                return False
            self.in_call, self.index, self.params, self.closed = True, None, 0, False
            return True
        s = self.buf.lstrip()  # whitespace between the tags is layout
        if self.index is None:
            m = _FUNCTION.match(s)
            if m is not None:
                self.index, self.buf = self._start_call(m[1].strip()), s[m.end():]
                return True
            if not final and ("<function=".startswith(s) or (s.startswith("<function=") and ">" not in s)):
                return False
            self._text(self.OPEN + self.buf)  # not a call after all
            self.buf, self.in_call = "", False
            return True
        m = None if self.closed else _PARAMETER.match(s)
        if m is not None:
            self.buf = s[m.end():]
            self._call_args(self.index, ("{" if self.params == 0 else ", ") + dumps(m[1].strip()) + ": "
                            + dumps(_value(m[2])))
            self.params += 1
            return True
        if not self.closed and s.startswith("</function>"):
            self.buf = s[len("</function>"):]
            self._close_args()
            return True
        if s.startswith(self.CLOSE):
            self.buf = s[len(self.CLOSE):]
        elif not final and (not s or any(t.startswith(s) or s.startswith("<parameter=") for t in self.TAGS)):
            return False  # a tag or a parameter still coming
        else:  # cut off (a partial parameter is dropped), or text that does not belong here:
            self.buf = "" if final and s.startswith("<") else s  # end the call, the rest is content
        self._close_args()
        self.in_call = False
        return True

    def _close_args(self) -> None:
        if not self.closed:
            self._call_args(self.index, "}" if self.params else "{}")
            self.closed = True


def _value(raw: str) -> object:
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    try:
        return loads_strict(raw)
    except ValueError:
        return raw

"""The pythonic tool-call parser: `[get_weather(city="Paris"), get_time()]` (Llama 3.2/4 and
others). Each call is parsed with Python's `ast` once its element of the list is complete;
argument values must be literals (ast.literal_eval; nothing is evaluated). A call's arguments
go out as one fragment. An output that does not start with such a list is content; so is an
element that is not a call, and whatever follows it."""

from __future__ import annotations

import ast

from turbine.frontend.postprocess.parsers.base import ParserBase, dumps


class PythonicParser(ParserBase):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start -> list -> text
        self.lead = ""  # the text that opened the list, given back if its first element is no call
        self._reset_scan()

    def _reset_scan(self) -> None:
        self.pos, self.depth, self.quote, self.escape = 0, 0, "", False

    def _step(self, final: bool) -> bool:
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith("["):
                self.lead, self.buf, self.state = self.buf[:len(self.buf) - len(s) + 1], s[1:], "list"
            elif self._waiting_for(("[",), final):
                return False
            else:
                self.state = "text"
            return True
        if self.state == "list":
            end = self._element_end()
            if end is None:
                if final:  # cut off inside a call: give the list's text back
                    self._give_back("")
                    return True
                return False
            element, sep = self.buf[:end], self.buf[end]
            self.buf = self.buf[end + 1:]
            self._reset_scan()
            call = _call(element) if sep in ",]" else None
            if call is not None:
                self.lead = ""
                self._call_args(self._start_call(call[0]), call[1])
                if sep == "]":
                    self.state = "text"
            elif element.strip() or sep != "]" or not self.calls:
                self._give_back(element + sep)
            else:  # "]" after a trailing comma
                self.state = "text"
            return True
        self._text(self.buf)
        self.buf = ""
        return False

    def _give_back(self, taken: str) -> None:
        """Content from here: the list's opening (if no call came yet), `taken` and the rest."""
        self.buf, self.state = self.lead + taken + self.buf, "text"

    def _element_end(self) -> int | None:
        """Where the list's current element ends: at a "," or "]" outside brackets and strings
        (or at a stray closing bracket, which fails the element)."""
        buf = self.buf
        for i in range(self.pos, len(buf)):
            c = buf[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    return i
                self.depth -= 1
            elif c == "," and self.depth == 0:
                return i
        self.pos = len(buf)
        return None


def _call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `name(key=literal, ...)`, else None."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return name, dumps(args)
    except (TypeError, ValueError):  # a set, bytes, complex, NaN: no JSON for it
        return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None

"""Reasoning parsers for models that think between <think> and </think>: deepseek_r1, qwen3."""

from __future__ import annotations

from turbine.frontend.postprocess.parsers.base import ParserBase


class ThinkParser(ParserBase):
    """Text up to `</think>` is reasoning, the rest content (whitespace right after the tag is
    dropped). An opening `<think>` at the start is dropped. Without one the output is reasoning
    when `open_optional` (DeepSeek-R1: its template may put `<think>` in the prompt), else all
    content. With `enable_thinking` off (the request's chat_template_kwargs) everything is
    content."""

    OPEN, CLOSE = "<think>", "</think>"
    open_optional = False

    def __init__(self, enable_thinking: bool = True):
        super().__init__()
        self.state = "start" if enable_thinking else "content"

    def _step(self, final: bool) -> bool:
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(self.OPEN):
                self.buf, self.state = s[len(self.OPEN):], "reasoning"
            elif self._waiting_for((self.OPEN,), final):
                return False
            else:
                self.state = "reasoning" if self.open_optional else "content"
            return True
        if self.state == "reasoning":
            text, marker = self._cut((self.CLOSE,), final)
            self._reasoning(text)
            if marker is None:
                return False
            self.state = "gap"
            return True
        if self.state == "gap":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.state = "content"
        self._text(self.buf)
        self.buf = ""
        return False


class DeepSeekR1Parser(ThinkParser):
    open_optional = True


class Qwen3Parser(ThinkParser):
    open_optional = False

"""The harmony parser (gpt-oss), both reasoning and tool calls: the output is messages

    <|channel|>analysis<|message|>…<|end|>                  reasoning
    <|start|>assistant<|channel|>final<|message|>…<|return|>   content
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>   a tool call

(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>…`).
Commentary without a recipient is content; text outside any message is content. The markers
are special tokens: the detokenizer must keep them (skip_special_tokens off)."""

from __future__ import annotations

import re

from turbine.frontend.postprocess.parsers.base import ArgsStream, ParserBase, arguments_text, json_value, partial_json

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(ParserBase):
    def __init__(self, enable_thinking: bool = True):  # gpt-oss always writes its channels
        super().__init__()
        self.state = "outside"  # outside -> header -> body -> outside ...
        self.header = ""
        self.kind = ""  # of the body: reasoning, content or tool
        self.raw = ""  # a tool call's arguments so far
        self.args: ArgsStream | None = None

    def _step(self, final: bool) -> bool:
        if self.state == "outside":
            text, marker = self._cut((START, CHANNEL), final)
            self._text(text)
            if marker is None:
                return False
            self.state, self.header = "header", "" if marker == START else marker
            return True
        if self.state == "header":
            text, marker = self._cut((MESSAGE,), final)
            self.header += text
            if marker is None:
                return False  # a header cut off by the end is dropped: it is no text
            self._open(self.header)
            self.state = "body"
            return True
        text, marker = self._cut(ENDS, final)
        if self.kind == "reasoning":
            self._reasoning(text)
        elif self.kind == "content":
            self._text(text)
        else:
            assert self.args is not None
            self.raw += text
            if marker is None and not final:
                self.args.partial(partial_json(self.raw))
                return False
            self.args.final(arguments_text(json_value(self.raw)))
        if marker is None:
            return False
        self.state = "outside"
        return True

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            self.kind, self.raw = "tool", ""
            self.args = ArgsStream(self, self._start_call(recipient[1].removeprefix("functions.")))
        else:
            self.kind = "reasoning" if channel is not None and channel[1] == "analysis" else "content"

"""The format stage: Deltas -> OpenAI's response shapes, chat or completions, whole (JSON) or
streamed (SSE chunks). One class per endpoint kind; nothing here knows about workers."""

from __future__ import annotations

import time

import msgspec

from turbine.frontend.deltas import Delta, TokenLogprob, ToolCallDelta, UsageCount
from turbine.frontend.models.tokenizer import TextTokenizer

_json = msgspec.json.Encoder()


class ResponseFormat:
    object: str  # of a whole response
    chunk_object: str  # of a streamed chunk
    id_prefix: str

    def __init__(self, tokenizer: TextTokenizer, model: str, request_id: str, with_logprobs: bool,
                 echo: str | None = None):
        self.tokenizer = tokenizer
        self.model = model
        self.id = self.id_prefix + request_id
        self.with_logprobs = with_logprobs
        self.echo = echo  # completions: the prompt text written before each choice's output
        self.prompt_logprobs: list[TokenLogprob] = []  # echo with logprobs: set to the postprocess's list

    # -- whole response ----------------------------------------------------------------
    def response(self, choices: list[dict], usage: UsageCount) -> bytes:
        return _json.encode({"id": self.id, "object": self.object, "created": int(time.time()),
                             "model": self.model, "choices": choices, "usage": usage_json(usage)})

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        """One finished choice from all its deltas."""
        raise NotImplementedError

    # -- streamed response -------------------------------------------------------------
    def opening(self, n: int) -> list[list[dict]]:
        """Chunks (as their choices) sent before any output."""
        return []

    def chunk_choice(self, delta: Delta) -> dict:
        raise NotImplementedError

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        raise NotImplementedError

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChatFormat(ResponseFormat):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        message: dict = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        reasoning = "".join(d.reasoning for d in deltas)
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [c for d in deltas for c in d.tool_calls or ()]
        if calls:
            message["tool_calls"] = _whole_tool_calls(calls)
            if not message["content"]:
                message["content"] = None  # as OpenAI answers with calls only
        return {"index": index, "message": message, "logprobs": self._all_logprobs(deltas),
                "finish_reason": deltas[-1].finish_reason if deltas else None}

    def opening(self, n: int) -> list[list[dict]]:
        return [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(n)]]

    def chunk_choice(self, delta: Delta) -> dict:
        body: dict = {"content": delta.text}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = [_tool_call_fragment(c) for c in delta.tool_calls]
        return {"index": delta.index, "delta": body,
                "logprobs": self.logprobs(delta.logprobs) if self.with_logprobs else None,
                "finish_reason": delta.finish_reason}

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        content = []
        for e in entries:
            s = self._piece(e.token_id)
            tops = [(self._piece(t), lp) for t, lp in e.top]
            content.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": ts, "logprob": lp, "bytes": list(ts.encode())}
                                             for ts, lp in tops]})
        return {"content": content}

    def _all_logprobs(self, deltas: list[Delta]) -> dict | None:
        return self.logprobs([e for d in deltas for e in d.logprobs]) if self.with_logprobs else None


class CompletionFormat(ResponseFormat):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        lp = (self.logprobs(self.prompt_logprobs + [e for d in deltas for e in d.logprobs])
              if self.with_logprobs else None)
        return {"index": index, "text": (self.echo or "") + "".join(d.text for d in deltas), "logprobs": lp,
                "finish_reason": deltas[-1].finish_reason if deltas else None}

    def opening(self, n: int) -> list[list[dict]]:
        if not self.echo:
            return []
        lp = self.logprobs(self.prompt_logprobs) if self.with_logprobs else None
        return [[{"index": i, "text": self.echo, "logprobs": lp, "finish_reason": None} for i in range(n)]]

    def chunk_choice(self, delta: Delta) -> dict:
        return {"index": delta.index, "text": delta.text,
                "logprobs": self.logprobs(delta.logprobs) if self.with_logprobs else None,
                "finish_reason": delta.finish_reason}

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        return {"tokens": [self._piece(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {self._piece(t): lp for t, lp in e.top}
                                 for e in entries],
                "text_offset": []}


FORMATS: dict[str, type[ResponseFormat]] = {"chat": ChatFormat, "completions": CompletionFormat}


class SseChunks:
    """Encodes one streamed response's chunks. Every chunk shares its head and tail: they are
    encoded once per response, not once per token."""

    def __init__(self, fmt: ResponseFormat, include_usage: bool):
        """With `include_usage` every chunk has a `usage` key (null but on the last one, or the
        usage so far when the caller passes it: continuous usage stats)."""
        head = _json.encode({"id": fmt.id, "object": fmt.chunk_object, "created": int(time.time()),
                             "model": fmt.model})
        self._prefix = b"data: " + head[:-1] + b',"choices":'
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def chunk(self, choices: list[dict], usage: UsageCount | None = None) -> bytes:
        if usage is not None:
            return self._prefix + _json.encode(choices) + b',"usage":' + _json.encode(usage_json(usage)) + b"}\n\n"
        return self._prefix + _json.encode(choices) + self._tail

    @staticmethod
    def error(message: str, type_: str, code: str | None) -> bytes:
        return b"data: " + _json.encode({"error": {"message": message, "type": type_, "param": None,
                                                   "code": code}}) + b"\n\n"

    DONE = b"data: [DONE]\n\n"


def usage_json(u: UsageCount) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _tool_call_fragment(c: ToolCallDelta) -> dict:
    out: dict = {"index": c.index}
    if c.id is not None:
        out["id"], out["type"] = c.id, "function"
    function: dict = {"arguments": c.arguments}
    if c.name is not None:
        function["name"] = c.name
    out["function"] = function
    return out


def _whole_tool_calls(fragments: list[ToolCallDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for c in fragments:
        call = calls.setdefault(c.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if c.id is not None:
            call["id"] = c.id
        if c.name is not None:
            call["function"]["name"] = c.name
        call["function"]["arguments"] += c.arguments
    return [calls[i] for i in sorted(calls)]

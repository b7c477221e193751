"""The Responses API's output (turbine/frontend/apis/responses.py runs the request): one response's
`Delta`s become its output items — reasoning, message (output text, with its logprobs when asked
for), function_call — and the semantic stream events the official client's `responses.stream()`
reads (`response.created` ... `response.completed` / `response.incomplete`, or `error` then
`response.failed`), numbered by `sequence_number`. The whole response is built by the same code."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import msgspec

from turbine.frontend.deltas import Delta, UsageCount
from turbine.frontend.errors import RequestError, WorkerFailed

if TYPE_CHECKING:
    from turbine.frontend.preprocess.schemas import ResponsesRequest

_json = msgspec.json.Encoder()


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


class ResponseBuilder:
    """Builds one response's output items from its deltas, and the stream events that say
    so. The whole (non-streamed) response is built by the same code with its events unused,
    so the two can't disagree. At most one item is open at a time: reasoning, a message, or
    a function call (a tool-call parser emits one call whole before the next)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, count_tokens, *, store: bool = False,
                 conversation_id: str | None = None, token_text=None):
        self.req = req
        self.id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.count_tokens = count_tokens  # text -> tokens, for usage's reasoning_tokens (None: unknown)
        self.store = store
        self.conversation_id = conversation_id
        # token id -> its text: the output text's logprobs (include message.output_text.logprobs)
        self.token_text = token_text
        self.with_logprobs = token_text is not None and "message.output_text.logprobs" in (req.include or ())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.open: dict[str, Any] | None = None
        self.open_call_index: int | None = None
        self.held_space = ""  # whitespace not yet in a message: dropped if only tool calls follow
        self.finish_reason: str | None = None
        self._text_prefix: tuple[dict, bytes] | None = None  # (the open message, its text events' head)
        self._pending: list[str] = []  # push_encoded's text of that message, not yet in its part

    def _event(self, type_: str, **fields) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    # -- the response object --
    def _flush_text(self) -> None:
        """The open message's text pieces (push_encoded's) joined into its part: once, not per delta."""
        if self._pending:
            self._text_prefix[0]["content"][0]["text"] += "".join(self._pending)
            self._pending.clear()

    def response(self, status: str, usage: UsageCount | None = None, error: dict | None = None) -> dict[str, Any]:
        self._flush_text()
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model, "output": list(self.output),
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": self.store,
            "background": bool(req.background),
            "conversation": {"id": self.conversation_id} if self.conversation_id else None,
            "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "safety_identifier": req.safety_identifier, "service_tier": "default", "metadata": req.metadata or {},
            "usage": self._usage(usage) if usage is not None else None,
        }

    def _logprobs(self, delta: Delta, with_bytes: bool) -> list[dict[str, Any]]:
        if not self.with_logprobs:
            return []
        out = []
        for e in delta.logprobs:
            token = self.token_text(e.token_id)
            tops = [(self.token_text(t), lp) for t, lp in e.top]
            entry = {"token": token, "logprob": e.logprob,
                     "top_logprobs": [{"token": t, "logprob": lp} | ({"bytes": list(t.encode())} if with_bytes else {})
                                      for t, lp in tops]}
            if with_bytes:
                entry["bytes"] = list(token.encode())
            out.append(entry)
        return out

    def _usage(self, u: UsageCount) -> dict[str, Any]:
        reasoning = "".join(c["text"] for item in self.output if item["type"] == "reasoning"
                            for c in item["content"])
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens}
        # Re-encoded from the reasoning text: the workers do not count reasoning tokens apart. In
        # text mode the frontend has no tokenizer, and the count is left out rather than guessed.
        if not reasoning or self.count_tokens is not None:
            usage["output_tokens_details"] = {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0}
        return usage

    # -- events --
    def start(self) -> list[dict[str, Any]]:
        created = self.response("in_progress")
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def start_encoded(self) -> bytes:
        """`start()`'s two events as SSE bytes, the response they share encoded once."""
        created = _json.encode(self.response("in_progress"))
        out = b""
        for kind in ("response.created", "response.in_progress"):
            out += (b"event: " + kind.encode() + b'\ndata: {"type":"' + kind.encode() + b'","sequence_number":'
                    + str(self.seq).encode() + b',"response":' + created + b"}\n\n")
            self.seq += 1
        return out

    def push(self, delta: Delta) -> list[dict[str, Any]]:
        self._flush_text()
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._close()
                events += self._open({"id": _new_id("rs_"), "type": "reasoning", "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"},
                                     {"type": "reasoning_text", "text": ""})
            events += self._append_text(delta.reasoning, "response.reasoning_text.delta")
        if delta.text:
            text = self.held_space + delta.text
            if self.open is None or self.open["type"] != "message":
                if not text.strip():
                    self.held_space = text  # maybe only the gap before a tool call
                    text = ""
                else:
                    self.held_space = ""
                    events += self._close()
                    events += self._open({"id": _new_id("msg_"), "type": "message", "role": "assistant",
                                          "status": "in_progress", "content": []},
                                         {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            if text:
                self.held_space = ""
                logprobs = self._logprobs(delta, with_bytes=False)
                if logprobs:
                    self.open["content"][0]["logprobs"] += self._logprobs(delta, with_bytes=True)
                events += self._append_text(text, "response.output_text.delta", logprobs=logprobs)
        for call in delta.tool_calls or ():
            if call.index != self.open_call_index:
                events += self._close()
                self.held_space = ""
                self.open_call_index = call.index
                events += self._open({"id": _new_id("fc_"), "type": "function_call", "status": "in_progress",
                                      "call_id": call.id or _new_id("call_"), "name": call.name or "",
                                      "arguments": ""}, None)
            item = self.open
            if call.name and not item["name"]:
                item["name"] = call.name
            if call.arguments:
                item["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=len(self.output) - 1, delta=call.arguments))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return events

    def finish(self, usage: UsageCount) -> list[dict[str, Any]]:
        """The events that close the open item, then the final one."""
        return self.close_all() + [self.final(usage)]

    def close_all(self) -> list[dict[str, Any]]:
        self._flush_text()
        events = []
        if self.held_space and not self.output:  # whitespace was all the model said
            events += self._open({"id": _new_id("msg_"), "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []},
                                 {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events += self._append_text(self.held_space, "response.output_text.delta", logprobs=[])
        return events + self._close()

    def final(self, usage: UsageCount, response: dict[str, Any] | None = None) -> dict[str, Any]:
        """The last event: response.completed, or response.incomplete (cut by max_output_tokens);
        `response`: the final response object when already built."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return self._event("response." + status, response=response or self.response(status, usage))

    def fail(self, exc: RequestError) -> list[dict[str, Any]]:
        """The events that end a stream that failed after it started."""
        code = "server_error" if isinstance(exc, WorkerFailed) or exc.status >= 500 else "invalid_prompt"
        error = self._event("error", code=exc.code or code, message=exc.message, param=exc.param)
        return [error, self._event("response.failed",
                                   response=self.response("failed", error={"code": code, "message": exc.message}))]

    # -- items --
    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        added = dict(item, content=[]) if "content" in item else dict(item)
        events = [self._event("response.output_item.added", output_index=index, item=added)]
        if part is not None:
            if item["type"] == "message":
                item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        return events

    def push_encoded(self, delta: Delta) -> bytes:
        """`push(delta)`'s events as SSE bytes. The common delta, more text of the open message, takes a
        path that encodes only its text and sequence number: the rest of the event is the same for
        every delta of the message, encoded once (as the chat path's SseChunks does)."""
        open_ = self.open
        if (open_ is None or open_["type"] != "message" or self.held_space or not delta.text or delta.reasoning
                or delta.tool_calls or self.with_logprobs or delta.finish_reason is not None):
            return b"".join(sse_event(e) for e in self.push(delta))
        if self._text_prefix is None or self._text_prefix[0] is not open_:
            head = _json.encode({"type": "response.output_text.delta", "item_id": open_["id"],
                                 "output_index": len(self.output) - 1, "content_index": 0, "logprobs": []})
            self._text_prefix = (open_, b"event: response.output_text.delta\ndata: " + head[:-1]
                                 + b',"sequence_number":')
        self._pending.append(delta.text)
        seq = self.seq
        self.seq += 1
        return self._text_prefix[1] + str(seq).encode() + b',"delta":' + _json.encode(delta.text) + b"}\n\n"

    def _append_text(self, text: str, event_type: str, **extra) -> list[dict[str, Any]]:
        part = self.open["content"][0]
        part["text"] += text
        return [self._event(event_type, item_id=self.open["id"], output_index=len(self.output) - 1,
                            content_index=0, delta=text, **extra)]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open, self.open_call_index = self.open, None, None
        if item is None:
            return []
        index = len(self.output) - 1
        # An item cut by max_output_tokens says so (a cut call's arguments are not a complete call).
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"],
                                          logprobs=[{k: v for k, v in e.items() if k != "bytes"}
                                                    | {"top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                                                        for t in e["top_logprobs"]]}
                                                    for e in part["logprobs"]]))
            else:
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _json.encode(event) + b"\n\n"

"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages API): a Messages
body becomes a chat completions body (system, messages with text / image / tool_use / tool_result /
thinking blocks, tools, tool_choice, output_config.format) and runs the chat path's stages, so the
tool-call parsers, forced tool calls and structured outputs are the chat path's. Its deltas become
a message whose content holds thinking, text and tool_use blocks, with `stop_reason` and usage, or
the stream events Anthropic's SDK reads (`message_start`, `content_block_start` / `_delta` /
`_stop`, `message_delta`, `message_stop`). Errors are in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`), an `error` event once a stream has started.

Every field of the SDK's `MessageCreateParams` is honoured or refused with a 400 naming it.
`cache_control` (on the request, blocks, tools) is honoured as it is: prefixes are cached by the
engines automatically (prefix caching, KV-aware routing), whatever is marked."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response

from turbine.frontend.deltas import Delta, UsageCount
from turbine.frontend.errors import RequestError
from turbine.frontend.event_stream import EventStreamResponse
from turbine.frontend.pipeline import Pipeline, Writing
from turbine.frontend.preprocess.media import MediaConfig
from turbine.frontend.preprocess.schemas import ChatCompletionRequest, invalid, json_object
from turbine.frontend.preprocess.stage import Prepared, preprocess_chat

log = logging.getLogger("turbine.frontend")
_json = msgspec.json.Encoder()


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # required on /v1/messages, absent on count_tokens
    system: str | list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None  # {user_id}: logged, as OpenAI's `user`
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {type: disabled}; enabled / adaptive refused (budgets)
    output_config: dict[str, Any] | None = None  # {format: {type: json_schema, schema}}
    service_tier: str | None = None  # auto / standard_only: the one tier here
    cache_control: dict[str, Any] | None = None  # automatic here (module docstring)


REFUSED_FIELDS = {
    "container": "this server runs no code-execution containers",
    "diagnostics": "this server returns no diagnostics",
    "inference_geo": "this server runs where it is deployed",
    "speed": "this server has one speed",
    "user_profile_id": "this server has no user profiles",
    "workspace_id": "this server has no workspaces",
    "context_management": "this server does not edit context; send what the model should see",
    "mcp_servers": "this server connects to no MCP servers; run tools on the client",
}
_FIELDS = frozenset(MessagesRequest.__struct_fields__)
_BLOCK_KEYS = {"text": {"text", "cache_control", "citations"},
               "image": {"source", "cache_control"},
               "tool_use": {"id", "name", "input", "cache_control"},
               "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
               "thinking": {"thinking", "signature"}}
# A chat-path parameter named in an error -> the Messages field the client sent.
_PARAM_OF_CHAT = {"messages": "messages", "max_completion_tokens": "max_tokens", "max_tokens": "max_tokens",
                  "response_format": "output_config.format", "stop": "stop_sequences"}


def _fail(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param)


def decode_messages_request(body: bytes, count_only: bool = False) -> MessagesRequest:
    raw = json_object(body)
    for name in list(raw):
        if name in REFUSED_FIELDS:
            if raw[name] is not None:
                raise _fail(name, f"is not supported: {REFUSED_FIELDS[name]}")
            del raw[name]
        elif name not in _FIELDS or (count_only and name in ("max_tokens", "stream", "stop_sequences", "metadata",
                                                                 "temperature", "top_k", "top_p", "service_tier")):
            raise _fail(name, "is not supported by this server's /v1/messages" + ("/count_tokens" if count_only else ""))
    try:
        req = msgspec.convert(raw, MessagesRequest)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None
    if not count_only and req.max_tokens is None:
        raise _fail("max_tokens", "is required")
    return req


# -- Messages body -> chat body ----------------------------------------------------------
def chat_body(req: MessagesRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "stream": req.stream, "messages": _messages(req)}
    for name, value in (("max_completion_tokens", req.max_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("top_k", req.top_k), ("stop", req.stop_sequences)):
        if value is not None:
            body[name] = value
    if req.metadata is not None:
        for key in req.metadata:
            if key != "user_id":
                raise _fail(f"metadata.{key}", "is not supported (metadata takes user_id)")
        if req.metadata.get("user_id") is not None:
            body["user"] = str(req.metadata["user_id"])
    if req.service_tier not in (None, "auto", "standard_only"):
        raise _fail("service_tier", "must be auto or standard_only")
    if req.cache_control is not None:
        _cache_control(req.cache_control, "cache_control")
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            raise _fail("thinking", "thinking budgets are not enforced here; leave thinking out (a model whose "
                        "worker has a reasoning parser answers with thinking blocks) or send {type: disabled}")
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice, parallel = _chat_tool_choice(req.tool_choice)
        body["tool_choice"] = choice
        if parallel is False and req.tools:
            body["parallel_tool_calls"] = False
    if req.output_config is not None:
        for key, value in req.output_config.items():
            if key == "format" and value is not None:
                body["response_format"] = _response_format(value)
            elif value is not None:
                raise _fail(f"output_config.{key}", "is not supported (output_config takes format)")
    return body


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else "".join(
            _text_block(b, f"system[{i}]") for i, b in enumerate(req.system))
        messages.append({"role": "system", "content": text})
    if not req.messages:
        raise _fail("messages", "must not be empty")
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        for key in msg:
            if key not in ("role", "content"):
                raise _fail(f"{where}.{key}", "is not supported")
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            raise _fail(f"{where}.role", "must be user or assistant")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _fail(f"{where}.content", "must be a string or a list of content blocks")
        if role == "user":
            messages += _user_turn(blocks, where)
        else:
            messages.append(_assistant_turn(blocks, where))
    return messages


def _check_block(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise _fail(f"{where}.type", f"content blocks of type {kind!r} are not supported here; use "
                    + ", ".join(allowed))
    for key in block:
        if key != "type" and key not in _BLOCK_KEYS[kind]:
            raise _fail(f"{where}.{key}", "is not supported")
    if "cache_control" in block and block["cache_control"] is not None:
        _cache_control(block["cache_control"], f"{where}.cache_control")
    return kind


def _cache_control(value: Any, where: str) -> None:
    if not (isinstance(value, dict) and value.get("type") == "ephemeral" and set(value) <= {"type", "ttl"}):
        raise _fail(where, "must be {type: ephemeral} (prefixes are cached automatically here)")


def _text_block(block: Any, where: str) -> str:
    _check_block(block, where, ("text",))
    if not isinstance(block.get("text"), str):
        raise _fail(f"{where}.text", "is required and must be a string")
    if block.get("citations"):
        raise _fail(f"{where}.citations", "is not supported")
    return block["text"]


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool_result blocks become tool messages (they answer the assistant's calls,
    which come just before), the rest one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _check_block(block, at, ("text", "image", "tool_result"))
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        else:
            if not isinstance(block.get("tool_use_id"), str):
                raise _fail(f"{at}.tool_use_id", "is required and must be a string")
            content = block.get("content", "")
            if isinstance(content, list):
                content = "".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
            elif not isinstance(content, str):
                raise _fail(f"{at}.content", "must be a string or text blocks")
            if block.get("is_error"):
                content = "Error: " + content
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out


def _image_url(source: Any, where: str) -> str:
    if not isinstance(source, dict):
        raise _fail(where, "is required: {type: base64, media_type, data} or {type: url, url}")
    if source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str) and set(source) == {"type", "media_type", "data"}:
        return f"data:{source['media_type']};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str) and set(source) == {"type", "url"}:
        return source["url"]
    raise _fail(where, "must be {type: base64, media_type, data} or {type: url, url} (files are not supported)")


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _check_block(block, at, ("text", "tool_use", "thinking"))
        if kind == "text":
            turn["content"] += _text_block(block, at)
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _fail(f"{at}.thinking", "is required and must be a string")
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block["thinking"]
        else:
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise _fail(at, "a tool_use block has an id, a name and an input object")
            turn.setdefault("tool_calls", []).append(
                {"id": block["id"], "type": "function",
                 "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
    return turn


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if tool.get("type") not in (None, "custom"):
        raise _fail(f"{where}.type", f"{tool.get('type')!r}: only custom tools (name, description, input_schema) "
                    "are supported; server tools run nowhere here")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _fail(f"{where}.name", "is required and must be a non-empty string")
    if not isinstance(tool.get("input_schema"), dict):
        raise _fail(f"{where}.input_schema", "is required and must be a JSON schema object")
    function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
    for key, value in tool.items():
        if key == "description":
            function["description"] = value
        elif key == "strict":
            function["strict"] = value
        elif key == "cache_control":
            if value is not None:
                _cache_control(value, f"{where}.cache_control")
        elif key not in ("type", "name", "input_schema"):
            raise _fail(f"{where}.{key}", "is not supported")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    kind = choice.get("type")
    allowed = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
               "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in allowed:
        raise _fail("tool_choice.type", "must be auto, any, tool or none")
    for key in choice:
        if key not in allowed[kind]:
            raise _fail(f"tool_choice.{key}", "is not supported")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _fail("tool_choice.name", "is required")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
            or set(fmt) - {"type", "schema"}:
        raise _fail("output_config.format", "must be {type: json_schema, schema: {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


async def prepare(body: bytes, models, media: MediaConfig = MediaConfig(),
                  count_only: bool = False) -> tuple[MessagesRequest, Prepared]:
    req = decode_messages_request(body, count_only)
    chat = chat_body(req)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise _fail("max_tokens", "must be >= 1")
    try:
        # The chat dict converted to the typed request in place (no JSON round trip), checked as a decoded body is.
        try:
            chat_req = msgspec.convert(chat, ChatCompletionRequest)
        except msgspec.ValidationError as exc:
            raise invalid(exc) from None
        prepared = await preprocess_chat(chat_req, models, media)
    except RequestError as exc:
        if exc.param in _PARAM_OF_CHAT:
            exc.param = _PARAM_OF_CHAT[exc.param]
        raise
    return req, prepared


def count_tokens(prepared: Prepared) -> dict[str, int]:
    if prepared.model.tokenizer is None:
        raise RequestError(f"model: {prepared.model.name!r} is served in text mode (--use-vllm-tokenizer); this "
                           "frontend has no tokenizer to count with", param="model")
    return {"input_tokens": len(prepared.request.token_ids)}


# -- errors -------------------------------------------------------------------------------
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPE.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def anthropic_error(response: Response) -> Response:
    """An OpenAI-shaped error answer (from the shared http stage) in Anthropic's shape."""
    try:
        message = json.loads(response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response
    out = error_response(response.status_code, message)
    for name in ("retry-after", "allow"):
        if name in response.headers:
            out.headers[name] = response.headers[name]
    return out


# -- deltas -> a message and its stream events ---------------------------------------------
class MessageBuilder:
    """One message's content blocks from its deltas, and the stream events that say so; the whole
    message is built by the same code (its events unused)."""

    def __init__(self, req: MessagesRequest, message_id: str, model: str, prompt_tokens: int):
        self.req, self.id, self.model = req, message_id, model
        self.prompt_tokens = prompt_tokens
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_call_index: int | None = None
        self.arguments: dict[int, str] = {}  # a tool_use block's JSON text, by its content index
        self.held_space = ""
        self.finish_reason: str | None = None

    def message(self, usage: UsageCount | None, stop_reason: str | None = None,
                stop_sequence: str | None = None) -> dict[str, Any]:
        u = usage or UsageCount(self.prompt_tokens)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self._whole(i, b) for i, b in enumerate(self.content)] if usage else [],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
                          "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}}

    def _whole(self, index: int, block: dict[str, Any]) -> dict[str, Any]:
        if block["type"] != "tool_use":
            return block
        try:
            args = json.loads(self.arguments.get(index) or "{}")
        except ValueError:
            args = None
        return dict(block, input=args if isinstance(args, dict) else {})

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message(None)}, {"type": "ping"}]

    def push(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self.open is None or self.open["type"] != "thinking":
                events += self._close()
                events += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.open["thinking"] += delta.reasoning
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            text = self.held_space + delta.text
            if self.open is None or self.open["type"] != "text":
                if not text.strip():
                    self.held_space, text = text, ""  # maybe only the gap before a tool call
                else:
                    events += self._close()
                    events += self._open({"type": "text", "text": ""})
            if text:
                self.held_space = ""
                self.open["text"] += text
                events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.tool_calls or ():
            if call.index != self.open_call_index:
                events += self._close()
                self.held_space = ""
                self.open_call_index = call.index
                events += self._open({"type": "tool_use", "id": call.id or "toolu_" + os.urandom(12).hex(),
                                      "name": call.name or "", "input": {}})
                self.arguments[len(self.content) - 1] = ""
            if call.name and not self.open["name"]:
                self.open["name"] = call.name
            if call.arguments:
                self.arguments[len(self.content) - 1] += call.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return events

    def stop_reason(self) -> str:
        if self.finish_reason == "length":
            return "max_tokens"
        if any(b["type"] == "tool_use" for b in self.content):
            return "tool_use"
        return "end_turn"

    def finish(self, usage: UsageCount, stop_sequence: str | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.held_space and not self.content:  # whitespace was all the model said
            events += self._open({"type": "text", "text": self.held_space})
            events.append(self._delta({"type": "text_delta", "text": self.held_space}))
        events += self._close()
        reason = self.stop_reason()
        if reason == "max_tokens":
            self._drop_cut_call()
        sequence = stop_sequence if reason == "end_turn" else None
        message = self.message(usage, "stop_sequence" if sequence else reason, sequence)
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": message["stop_reason"], "stop_sequence": sequence},
                          "usage": message["usage"]},
                         {"type": "message_stop"}]

    def whole(self, usage: UsageCount, stop_sequence: str | None) -> dict[str, Any]:
        self.finish(usage, stop_sequence)
        reason = self.stop_reason()
        sequence = stop_sequence if reason == "end_turn" else None
        return self.message(usage, "stop_sequence" if sequence else reason, sequence)

    def _drop_cut_call(self) -> None:
        """A tool call cut by max_tokens is not a call: the whole message leaves it out (a stream has
        sent its fragments, and says max_tokens)."""
        if self.content and self.content[-1]["type"] == "tool_use":
            try:
                json.loads(self.arguments.get(len(self.content) - 1) or "")
            except ValueError:
                self.content.pop()

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.content.append(block)
        self.open = block
        start = dict(block)
        if block["type"] == "text":
            start["text"] = ""
        elif block["type"] == "thinking":
            start["thinking"] = ""
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open, self.open_call_index = None, None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _json.encode(event) + b"\n\n"


class MessagesRun(Pipeline):
    """Runs one Messages request through the chat pipeline and writes it, whole or streamed."""

    def __init__(self, req: MessagesRequest, prepared: Prepared, client, metrics, disagg, migration):
        super().__init__(prepared, client, metrics, disagg, migration)
        self.builder = MessageBuilder(req, "msg_" + prepared.request.request_id, prepared.model.name,
                                      len(prepared.request.token_ids))

    def _stop_sequence(self) -> str | None:
        detoks = getattr(self.post, "detoks", None)  # text mode: the engine stopped it, unnamed
        return detoks[0].stop_reason if detoks else None

    async def whole(self) -> Response:
        with Writing(self.metrics, stream=False):
            async for delta in self.deltas:
                self.builder.push(delta)
        return Response(_json.encode(self.builder.whole(self.post.usage, self._stop_sequence())),
                        media_type="application/json")

    async def stream(self) -> EventStreamResponse:
        deltas, builder, metrics = self.deltas, self.builder, self.metrics
        first = await anext(deltas, None)  # errors before any output keep their HTTP status

        async def body():
            with Writing(metrics) as writing:
                try:
                    for event in builder.start():
                        yield sse_event(event)
                    delta = first
                    while delta is not None:
                        for event in builder.push(delta):
                            yield sse_event(event)
                        delta = await anext(deltas, None)
                    for event in builder.finish(self.post.usage, self._stop_sequence()):
                        yield sse_event(event)
                    writing.done = True
                except RequestError as exc:
                    log.warning("messages stream failed: %s", exc)
                    yield sse_event(error_body(exc.status, exc.message))
                    writing.done = True
                finally:
                    await deltas.aclose()

        return EventStreamResponse(body(), more_ready=self.more_ready)

"""`POST /v1/responses` (OpenAI's Responses API): a Responses body becomes a chat completions request
struct (messages, tools, tool_choice, response_format, logprobs; built directly, never re-encoded to
JSON) and runs the chat path's stages
(preprocess -> dispatch -> postprocess); the deltas are then written as a response object whose
`output` holds reasoning, message and function_call items, or as the semantic stream events
(`response.created` ... `response.completed`) the official client parses.

State (turbine/frontend/apis/stored_responses.py): with `store` (default true, as OpenAI's, unless the
frontend runs with `--response-store off`) the response is saved before its last byte is sent;
`previous_response_id` continues from a stored response (its input and output, and its
predecessors', become this request's context) and `conversation` from a conversation's items
(this request's input and output are then appended to it). `background` runs are in
turbine/frontend/apis/response_routes.py. Every field the official client's `ResponseCreateParams`
has is either honoured here or refused with a 400 naming it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgspec
from starlette.responses import Response

from turbine.frontend.apis.response_events import ResponseBuilder, sse_event
from turbine.frontend.apis.stored_responses import Records, StoredResponse, with_ids
from turbine.frontend.errors import RequestError
from turbine.frontend.event_stream import EventStreamResponse
from turbine.frontend.pipeline import Pipeline, Writing
from turbine.frontend.preprocess.media import DETAILS, MediaConfig
from turbine.frontend.preprocess.schemas import ChatCompletionRequest, ResponsesRequest, invalid, json_object
from turbine.frontend.preprocess.stage import Prepared, preprocess_chat
from turbine.frontend.preprocess.structured import JsonSchemaFormat, ResponseFormat

log = logging.getLogger("turbine.frontend")

_json = msgspec.json.Encoder()


# Fields of the official client's ResponseCreateParams this server does not act on: a 400 naming
# the field and why, when given a value other than null.
REFUSED_FIELDS = {
    "prompt": "this server keeps no prompt templates; send the prompt in instructions and input",
    "prompt_cache_key": "prompt caching here is automatic (prefix caching and KV-aware routing), with no key",
    "prompt_cache_retention": "cached prefixes are kept by the engines' cache, not per request",
    "prompt_cache_options": "cached prefixes are kept by the engines' cache, not per request",
    "max_tool_calls": "the number of tool calls is not bounded per request; use parallel_tool_calls: false "
                      "for at most one",
    "context_management": "this server does not compact context; send what the model should see",
    "moderation": "this server runs no moderation model",
    "background_options": "background runs take no options here",
    "access_programs": "this server has no access programs",
    "image": "image generation is not served here",
    "cyber": "not applicable to this server",
}
# What `include` may ask for: honoured, or (the tools' outputs this server has no tools for) refused.
INCLUDE_HONOURED = ("message.output_text.logprobs", "reasoning.encrypted_content")
SERVICE_TIERS = ("auto", "default")

_FIELDS = frozenset(ResponsesRequest.__struct_fields__)
# A chat-path parameter named in an error -> the Responses field the client sent.
_PARAM_OF_CHAT = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                  "response_format": "text.format", "tool_choice": "tool_choice", "top_logprobs": "top_logprobs",
                  "logprobs": "include"}
# Keys of input items that describe an item the client got back from us (echoed in agent
# loops that send `response.output` back); they ask for nothing.
_ECHOED_KEYS = {"id", "status", "type"}
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

def _fail(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param)


def decode_responses_request(body: bytes) -> ResponsesRequest:
    raw = json_object(body)
    for name in list(raw):
        if name in REFUSED_FIELDS:
            if raw[name] is not None:
                raise _fail(name, f"is not supported: {REFUSED_FIELDS[name]}")
            del raw[name]
        elif name not in _FIELDS:
            raise _fail(name, "is not supported by this server's /v1/responses")
    try:
        return msgspec.convert(raw, ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise invalid(exc) from None


# -- Responses request -> chat request ---------------------------------------------------
def chat_request(req: ResponsesRequest, origins: dict[str, str] | None = None,
                 items: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat request that asks for what `req` asks for (`items`: its whole input, a stored
    context first; default `req.input`), built as the struct the chat endpoint decodes into: its
    fields' types are the ones `req` was decoded with, and preprocess_chat checks it as it checks a
    decoded chat body. Raises RequestError naming the Responses field for anything this server
    cannot honour. `origins` (when given) gets each image's chat location -> its Responses
    location, for renaming the media stage's errors."""
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise _fail("reasoning", "reasoning effort and summaries are not configurable here; the model's "
                    "reasoning (when its worker has a reasoning parser) comes back as reasoning items")
    _check_metadata(req.metadata)
    logprobs = _check_include(req)
    if req.truncation not in (None, "disabled"):
        raise _fail("truncation", "only 'disabled' is supported: an input over the model's context is a 400, "
                    "never cut silently")
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise _fail("service_tier", f"this server has one tier; send {' or '.join(SERVICE_TIERS)}")
    if req.stream_options is not None:
        if not req.stream:
            raise _fail("stream_options", "is only allowed when stream is true")
        for key, value in req.stream_options.items():
            if key != "include_obfuscation":
                raise _fail(f"stream_options.{key}", "is not supported")
            if value is not False:
                raise _fail("stream_options.include_obfuscation", "this server adds no obfuscation padding; "
                            "send false")
    return ChatCompletionRequest(
        model=req.model, stream=req.stream,
        messages=messages_of(req.input if items is None else items, req.instructions, origins),
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, user=req.user,
        logprobs=logprobs, top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        tools=[_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=None if req.tool_choice is None else _chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=None if req.text is None else _response_format(req.text))


def _check_include(req: ResponsesRequest) -> bool:
    """Whether the output text's logprobs are asked for. `reasoning.encrypted_content` is honoured
    with what this server can truthfully give: reasoning items carry their text in `content`, which
    a client may send back as is; nothing is encrypted, so `encrypted_content` stays null."""
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDE_HONOURED:
            raise _fail(f"include[{i}]", f"{value!r} is not supported: this server runs no built-in tools and "
                        f"keeps no files; it honours {', '.join(INCLUDE_HONOURED)}")
    logprobs = "message.output_text.logprobs" in (req.include or ())
    if req.top_logprobs is not None and not logprobs:
        raise _fail("top_logprobs", "needs include: ['message.output_text.logprobs']")
    return logprobs


def messages_of(input_: str | list[dict[str, Any]], instructions: str | None,
                origins: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Chat messages for a Responses `input`. Consecutive assistant-side items (reasoning, an
    assistant message, function calls) become one assistant message, as a chat template
    expects a turn that thinks, says something and calls tools. A message with input_image
    parts becomes chat text and image_url parts (the chat path's media stage fetches and checks
    them); `origins` gets each image's chat location -> its `input` location."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        messages.append({"role": "user", "content": input_})
        return messages
    if not input_:
        raise _fail("input", "must not be empty")
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant_turn() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(input_):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            _only_keys(item, where, {"role", "content", "phase"})
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _fail(f"{where}.role", "must be user, system, developer or assistant")
            if role == "assistant":
                assistant_turn()["content"] += _text_of(item.get("content"), f"{where}.content")
            else:
                turn = None
                content = _content_of(item.get("content"), f"{where}.content", f"messages[{len(messages)}].content",
                                      origins)
                # Chat templates know system, not OpenAI's newer name for it.
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            _only_keys(item, where, {"call_id", "name", "arguments"})
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _fail(f"{where}.{key}", "is required and must be a string")
            assistant_turn().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            _only_keys(item, where, {"call_id", "output"})
            if not isinstance(item.get("call_id"), str):
                raise _fail(f"{where}.call_id", "is required and must be a string")
            turn = None
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            _only_keys(item, where, {"summary", "content", "encrypted_content"})
            if item.get("encrypted_content") is not None:
                raise _fail(f"{where}.encrypted_content", "this server issues no encrypted reasoning")
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _fail(f"{where}.content", "must be a list of reasoning_text parts")
            for j, part in enumerate(parts):
                if not (isinstance(part, dict) and part.get("type") == "reasoning_text"
                        and isinstance(part.get("text"), str)):
                    raise _fail(f"{where}.content[{j}]", "must be a reasoning_text part with a text")
            # The chat templates that render past reasoning read it from here.
            turn_ = assistant_turn()
            turn_["reasoning_content"] = turn_.get("reasoning_content", "") + "".join(p["text"] for p in parts)
        else:
            raise _fail(f"{where}.type", f"input items of type {kind!r} are not supported; use message, "
                        "function_call, function_call_output or reasoning")
    return messages


def _only_keys(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    for key in item:
        if key not in allowed and key not in _ECHOED_KEYS:
            raise _fail(f"{where}.{key}", "is not supported")


def _content_of(content: Any, where: str, chat_where: str, origins: dict[str, str] | None) -> str | list[dict]:
    """A user/system message's content for the chat path: its text, or (when it holds input_image
    parts) chat text and image_url parts in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, where, images=True)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "input_image"):
            parts.append({"type": "text", "text": _part_text(part, f"{where}[{j}]", True)})
            continue
        parts.append({"type": "image_url", "image_url": {"url": _image_url_of(part, f"{where}[{j}]")}})
        if origins is not None:
            origins[f"{chat_where}[{j}].image_url"] = f"{where}[{j}].image_url"
    return parts


def _image_url_of(part: dict[str, Any], where: str) -> str:
    """An input_image part's URL (data: or http(s); fetched and checked by the media stage)."""
    for key in part:
        if key not in ("type", "image_url", "file_id", "detail"):
            raise _fail(f"{where}.{key}", "is not supported")
    if part.get("file_id") is not None:
        raise _fail(f"{where}.file_id", "this server has no Files API; send the image as image_url "
                    "(a data: URL or an http(s) URL)")
    if part.get("detail") not in DETAILS:  # every picture is sized by the model's processor alike
        raise _fail(f"{where}.detail", f"{part['detail']!r} is not supported; send 'auto' (the model's image "
                    "processor decides the resolution)")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _fail(f"{where}.image_url", "is required and must be a data: URL or an http(s) URL")
    return url


def _renamed(exc: RequestError, origins: dict[str, str]) -> None:
    """The media stage names an image by its chat location: name it by its `input` location."""
    for chat_where, where in origins.items():
        if exc.message.startswith(chat_where):
            exc.message = where + exc.message[len(chat_where):]
            exc.args = (exc.message,)
            return


def _text_of(content: Any, where: str, images: bool = False) -> str:
    """The text of a message's content: a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of content parts")
    return "".join(_part_text(part, f"{where}[{j}]", images) for j, part in enumerate(content))


def _part_text(part: Any, where: str, images: bool) -> str:
    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise _fail(where, f"content parts of type {kind!r} are not supported; use input_text"
                    + (", output_text or input_image" if images else " or output_text"))
    for key in part:
        # annotations/logprobs come back on output_text parts we wrote; they ask for nothing.
        if key not in ("type", "text", "annotations", "logprobs"):
            raise _fail(f"{where}.{key}", "is not supported")
    if not isinstance(part.get("text"), str):
        raise _fail(f"{where}.text", "is required and must be a string")
    return part["text"]


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if tool.get("type") != "function":
        raise _fail(f"{where}.type", f"only function tools are supported, not {tool.get('type')!r}")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _fail(f"{where}.name", "is required and must be a non-empty string")
    function: dict[str, Any] = {"name": tool["name"]}
    for key in tool:
        if key in ("description", "parameters", "strict"):
            function[key] = tool[key]
        elif key not in ("type", "name"):
            raise _fail(f"{where}.{key}", "is not supported")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _fail("tool_choice", "must be auto, none, required or {type: function, name}")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise _fail("tool_choice", "a forced tool is {type: function, name: ...}; other kinds are not supported")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any]) -> ResponseFormat | None:
    for key in text:
        if key == "verbosity" and text[key] is None:
            continue
        if key != "format":
            raise _fail(f"text.{key}", "is not supported")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):  # was an AttributeError (a 500)
        raise _fail("text.format", "must be an object: {type: text | json_object | json_schema, ...}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.get("type") == "json_schema":
        for key in fmt:
            if key not in ("type", "name", "schema", "strict", "description"):
                raise _fail(f"text.format.{key}", "is not supported")
        if not isinstance(fmt.get("schema"), dict):
            raise _fail("text.format.schema", "is required and must be a JSON schema object")
        try:  # typed as the chat decoder types response_format.json_schema
            schema = msgspec.convert({k: v for k, v in fmt.items() if k != "type"}, JsonSchemaFormat)
        except msgspec.ValidationError as exc:
            raise invalid(exc, "text.format") from None
        return ResponseFormat(type="json_schema", json_schema=schema)
    raise _fail("text.format.type", "must be text, json_object or json_schema")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise _fail("metadata", f"at most {MAX_METADATA_KEYS} keys")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise _fail("metadata", f"keys are at most {MAX_METADATA_KEY} characters, "
                        f"values at most {MAX_METADATA_VALUE}")


@dataclasses.dataclass
class ResponseState:
    """What a Responses request stores, and where: the records (None: no store here), the
    caller's owner tag, this request's input items (with ids, as stored), and its conversation."""

    records: Records | None = None
    owner: str = ""
    store: bool = False
    input_items: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    conversation_id: str | None = None


def conversation_id_of(conversation: str | dict[str, Any] | None) -> str | None:
    if conversation is None or isinstance(conversation, str):
        return conversation
    if set(conversation) != {"id"} or not isinstance(conversation.get("id"), str):
        raise _fail("conversation", "is a conversation id or {id: ...}")
    return conversation["id"]


async def stored_context(req: ResponsesRequest, records: Records | None, owner: str) -> ResponseState:
    """The request's state: whether it is stored, and the items it continues from (a stored
    response's chain, or a conversation's items). Refused by name where this server has no store."""
    conversation_id = conversation_id_of(req.conversation)
    if records is None:
        for name, value in (("store", req.store), ("previous_response_id", req.previous_response_id),
                            ("conversation", conversation_id), ("background", req.background)):
            if value:
                raise _fail(name, "this frontend keeps no responses (--response-store off); send store: false "
                            "and the whole conversation in input")
        return ResponseState()
    store = req.store is not False
    if req.background:
        if not store:
            raise _fail("background", "a background response must be stored (store: true) to be polled")
        if req.stream:
            raise _fail("background", "streaming a background response is not supported; poll "
                        "GET /v1/responses/{id} instead")
    if req.previous_response_id is not None and conversation_id is not None:
        raise _fail("previous_response_id", "give previous_response_id or conversation, not both")
    if store:
        await records.kv.ready()  # a store that is down is a 503 before any generation, not after
    new_items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
        else list(req.input)
    state = ResponseState(records, owner, store, with_ids(new_items), conversation_id)
    if store:
        records.check_input_fits(state.input_items)
    return state


async def prepare(body: bytes, models, media: MediaConfig = MediaConfig(), records: Records | None = None,
                  owner: str = "") -> tuple[ResponsesRequest, Prepared, ResponseState]:
    """Decode, load the stored context, convert and run the chat preprocess stage (its media stage
    under the operator's bounds); errors name the Responses field."""
    req = decode_responses_request(body)
    state = await stored_context(req, records, owner)
    context: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        context = await records.context(req.previous_response_id, owner)
    elif state.conversation_id is not None:
        context = (await records.conversation(state.conversation_id, owner, "conversation")).items
    origins: dict[str, str] = {}
    items = context + state.input_items if state.records is not None else None
    chat = chat_request(req, origins, items)
    try:
        prepared = await preprocess_chat(chat, models, media)
    except RequestError as exc:
        if exc.param in _PARAM_OF_CHAT:  # "max_completion_tokens: ..." -> "max_output_tokens: ..."
            renamed = {f"{exc.param}:": f"{_PARAM_OF_CHAT[exc.param]}:"}
            exc.param = _PARAM_OF_CHAT[exc.param]
            _renamed(exc, renamed)
        _renamed(exc, origins)
        raise
    if prepared.constraint_param in _PARAM_OF_CHAT:  # a constraint the engine refuses names text.format
        prepared = dataclasses.replace(prepared, constraint_param=_PARAM_OF_CHAT[prepared.constraint_param])
    return req, prepared, state


class ResponsesRun(Pipeline):
    """Runs one Responses request through the chat pipeline and writes it, whole or streamed; a
    stored one is saved (and its conversation extended) before the client has its last event."""

    def __init__(self, req: ResponsesRequest, prepared: Prepared, client, metrics, disagg, migration,
                 state: ResponseState = ResponseState()):
        super().__init__(prepared, client, metrics, disagg, migration)
        tokenizer = prepared.model.tokenizer  # None in text mode
        count = None if tokenizer is None else lambda text: len(tokenizer.encode(text, add_special_tokens=False))
        token_text = None if tokenizer is None else lambda t: tokenizer.decode([t], skip_special_tokens=False)
        self.state = state
        self.builder = ResponseBuilder(req, "resp_" + prepared.request.request_id, prepared.model.name, count,
                                       store=state.store, conversation_id=state.conversation_id,
                                       token_text=token_text)

    @property
    def id(self) -> str:
        return self.builder.id

    async def persist(self, response: dict[str, Any]) -> None:
        """Saves the response (and appends to its conversation) when it is stored; raises
        StoreUnavailable (503) when the store cannot be reached."""
        state = self.state
        if not state.store or state.records is None:
            return
        record = StoredResponse(id=self.builder.id, owner=state.owner, response=response,
                                previous_response_id=self.builder.req.previous_response_id,
                                conversation_id=state.conversation_id, input_items=state.input_items)
        await state.records.save_response(record)
        if state.conversation_id is not None and response["status"] in ("completed", "incomplete"):
            added = state.input_items + response["output"]
            await state.records.change_conversation(state.conversation_id, state.owner,
                                                    lambda conv: conv.items.extend(added), "conversation")

    async def collect(self) -> dict[str, Any]:
        """The whole response object, once generated (not saved)."""
        builder = self.builder
        with Writing(self.metrics, stream=False):
            async for delta in self.deltas:
                builder.push(delta)
        return builder.finish(self.post.usage)[-1]["response"]

    async def whole(self) -> Response:
        final = await self.collect()
        await self.persist(final)
        return Response(_json.encode(final), media_type="application/json")

    async def stream(self) -> EventStreamResponse:
        deltas, builder, metrics = self.deltas, self.builder, self.metrics
        # The first output before answering, so that errors found before any output
        # (a bad request the worker refused, no reachable worker) keep their HTTP status.
        first = await anext(deltas, None)

        async def body():
            with Writing(metrics) as writing:
                try:
                    yield builder.start_encoded()
                    delta = first
                    while delta is not None:
                        yield builder.push_encoded(delta)
                        delta = await anext(deltas, None)
                    for event in builder.close_all():
                        yield sse_event(event)
                    final = builder.response("incomplete" if builder.finish_reason == "length" else "completed",
                                             self.post.usage)
                    await self.persist(final)  # before the client has the last event, and can ask for it
                    yield sse_event(builder.final(self.post.usage, final))
                    writing.done = True
                except RequestError as exc:
                    log.warning("responses stream failed: %s", exc)
                    for event in builder.fail(exc):
                        yield sse_event(event)
                    writing.done = True
                finally:
                    await deltas.aclose()

        return EventStreamResponse(body(), more_ready=self.more_ready)

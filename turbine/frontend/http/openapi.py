"""The frontend's OpenAPI 3.1 document (`GET /openapi.json`), generated from the very msgspec
structs that decode the request bodies (`msgspec.json.schema_components`), so it cannot drift
from what the server accepts. It also documents the one error shape every failure has
(`{"error": {"message", "type", "param", "code"}}`), which `schemathesis` checks against a
running frontend in CI (tests/integration/test_openapi_fuzz.py).

The document is the same for every deployment (no model names, nothing about the workers), so
it is served without the API key, like /health and /version; the operations that need the key
say so (`security: bearer`)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from turbine.frontend.apis.embeddings import EmbeddingRequest
from turbine.frontend.apis.images import ImageGenerationRequest
from turbine.frontend.preprocess.schemas import (
    LOGIT_BIAS_LIMIT,
    MAX_BATCH_PROMPTS,
    MAX_N,
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
)
from turbine.frontend.apis.anthropic import MessagesRequest
from turbine.frontend.http.utility_routes import VERSION, DetokenizeRequest, TokenizeRequest
from turbine.frontend.preprocess.schemas import ResponsesRequest

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{name}"

# What validate_chat and the tokenizer check of each message (the struct keeps messages as plain
# objects: chat templates take any keys).
_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
# An image: a data: URL (base64) or an http(s) URL, for models whose workers run with --enable-multimodal.
_IMAGE_PART = {"type": "object", "properties": {
    "type": {"const": "image_url"},
    "image_url": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}},
    "required": ["type", "image_url"]}
_CHAT_MESSAGE = {
    "type": "object",
    "properties": {"role": {"type": "string"},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                                         {"type": "null"}]}},
    "required": ["role"],
}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXT = {"type": "string", "minLength": 1}

# The ranges validate_sampling / validate_chat / validate_completion check (openai_schemas.py),
# written into the document so that clients (and the fuzzer's valid requests) see them; a
# property's null stays allowed. Checks across fields (stream_options needs stream, min_tokens
# <= max_tokens, the context length) are not expressed.
_RANGES: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "seed": {"minimum": -(2**63), "maximum": 2**63 - 1},
    "n": {"minimum": 1, "maximum": MAX_N},
    "min_tokens": {"minimum": 0},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
}
_REPLACED: dict[str, dict[str, Any]] = {  # properties whose struct type is wider than what is accepted
    "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, {"type": "null"}]},
    "stop_token_ids": {"anyOf": [_TOKEN_IDS | {"minItems": 0}, {"type": "null"}]},
    "logit_bias": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {
        "type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT}}, {"type": "null"}]},
}
_COMPLETION_ONLY: dict[str, dict[str, Any]] = {
    # one prompt (text or token ids) or a batch of them; null only with prompt_embeds
    "prompt": {"anyOf": [_TEXT, _TOKEN_IDS,
                         {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
                         {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
                         {"type": "null"}]},
    "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, {"type": "null"}]},
    "prompt_embeds": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # base64 of a torch.save'd tensor
}


def _constrained(struct: dict[str, Any], extra: dict[str, dict[str, Any]]) -> None:
    props = struct["properties"]
    for name, bounds in _RANGES.items():
        if name in props:
            prop = props[name]
            for option in prop.get("anyOf", [prop]):
                if option.get("type") in ("integer", "number"):
                    option.update(bounds)
    for name, schema in {**_REPLACED, **extra}.items():
        if name in props:
            props[name] = schema | ({"default": props[name]["default"]} if "default" in props[name] else {})

_ERROR = {
    "title": "Error",
    "description": "Every failure, in OpenAI's shape (a stream that has started ends with the same object "
                   "as an SSE event instead).",
    "type": "object",
    "properties": {"error": {
        "type": "object",
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
        "required": ["message", "type", "param", "code"],
    }},
    "required": ["error"],
}

_ANTHROPIC_ERROR = {
    "title": "AnthropicError",
    "description": "Every failure of /v1/messages, in Anthropic's shape (an `error` SSE event once a stream "
                   "has started).",
    "type": "object",
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        "required": ["type", "message"]}},
    "required": ["type", "error"],
}

# path -> (summary, request struct or None for GET, the 200 content types, needs the API key)
_JSON = {"application/json": {"schema": {"type": "object"}}}
_JSON_OR_SSE = {**_JSON, "text/event-stream": {}}
_OPERATIONS: dict[str, tuple[str, type[msgspec.Struct] | None, dict, bool]] = {
    "/v1/chat/completions": ("Chat completion (JSON, or SSE when stream is true)", ChatCompletionRequest,
                             _JSON_OR_SSE, True),
    "/v1/completions": ("Text completion (JSON, or SSE when stream is true)", CompletionRequest, _JSON_OR_SSE, True),
    "/v1/responses": ("Responses API (JSON, or SSE when stream is true); stored by default", ResponsesRequest,
                      _JSON_OR_SSE, True),
    "/v1/messages": ("Anthropic's Messages API (JSON, or SSE when stream is true); errors in Anthropic's shape",
                     MessagesRequest, _JSON_OR_SSE, True),
    "/v1/embeddings": ("Embeddings from pooling workers", EmbeddingRequest, _JSON, True),
    "/v1/images/generations": ("Images from omni workers whose pipeline ends in an image stage (b64_json PNGs)",
                               ImageGenerationRequest, _JSON, True),
    "/tokenize": ("A prompt or chat messages -> token ids (vLLM's shape)", TokenizeRequest, _JSON, True),
    "/detokenize": ("Token ids -> text (vLLM's shape)", DetokenizeRequest, _JSON, True),
    "/v1/models": ("The models with a live worker", None, _JSON, True),
    "/version": ("The server's version", None, _JSON, False),
    "/health": ("200 when some model has a live worker, else 503", None, _JSON, False),
    "/live": ("The process is up", None, _JSON, False),
    "/metrics": ("Prometheus metrics", None, {"text/plain": {"schema": {"type": "string"}}}, False),
}


@functools.cache
def openapi_json() -> bytes:
    return msgspec.json.encode(openapi_document())


def openapi_document() -> dict[str, Any]:
    structs = [s for _, s, _, _ in _OPERATIONS.values() if s is not None]
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    messages = components["ChatCompletionRequest"]["properties"]["messages"]
    messages.update(items=_CHAT_MESSAGE, minItems=1)
    _constrained(components["ChatCompletionRequest"], {})
    _constrained(components["CompletionRequest"], _COMPLETION_ONLY)
    components["CompletionRequest"]["anyOf"] = [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]
    # decode_responses_request refuses unknown fields itself (the struct does not forbid them).
    components["ResponsesRequest"]["additionalProperties"] = False
    components["MessagesRequest"]["additionalProperties"] = False
    components["MessagesRequest"]["required"] = sorted({*components["MessagesRequest"].get("required", []),
                                                        "max_tokens"})
    components["Error"] = _ERROR
    components["AnthropicError"] = _ANTHROPIC_ERROR
    paths: dict[str, Any] = {}
    for path, (summary, struct, ok, keyed) in _OPERATIONS.items():
        shape = "AnthropicError" if path.startswith("/v1/messages") else "Error"
        error = {"description": "An Anthropic-style error" if shape == "AnthropicError" else "An OpenAI-style error",
                 "content": {"application/json": {"schema": {"$ref": _REF.format(name=shape)}}}}
        op: dict[str, Any] = {"summary": summary, "operationId": path.strip("/").replace("/", "_") or "root",
                              "responses": {"200": {"description": "OK", "content": ok}, "4XX": error, "5XX": error}}
        if struct is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "$ref": _REF.format(name=struct.__name__)}}}}
        if path == "/health":
            op["responses"]["503"] = {"description": "No live worker", "content": _JSON}
        if keyed:
            op["security"] = [{"bearer": []}]
        paths[path] = {"post" if struct is not None else "get": op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Turbine frontend (OpenAI-compatible)", "version": VERSION,
                 "description": "Request bodies are generated from the server's own request structs; a field "
                                "the server does not implement is a 400 naming it."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "--api-key, when the frontend has one"}}},
    }

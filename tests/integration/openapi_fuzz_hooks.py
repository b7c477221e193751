"""schemathesis hooks for tests/integration/test_openapi_fuzz.py (loaded by `st run` through
SCHEMATHESIS_HOOKS): the OpenAI error-shape check, and valid bodies that mostly name the served
model so that generation itself is fuzzed, not only the model lookup."""

from __future__ import annotations

import json
import os
import zlib

import schemathesis

ERROR_KEYS = {"message", "type", "param", "code"}
SERVED_MODEL = os.environ.get("TURBINE_FUZZ_MODEL")


def _check_error(error: object, where: str) -> None:
    assert isinstance(error, dict) and set(error) == {"error"}, f"{where}: not an OpenAI error body: {error!r}"
    inner = error["error"]
    assert isinstance(inner, dict) and set(inner) == ERROR_KEYS, f"{where}: error keys {sorted(inner)}"
    assert isinstance(inner["message"], str) and inner["message"], f"{where}: empty message"
    assert isinstance(inner["type"], str) and inner["type"], f"{where}: empty type"
    assert inner["param"] is None or isinstance(inner["param"], str), f"{where}: param {inner['param']!r}"
    assert inner["code"] is None or isinstance(inner["code"], str), f"{where}: code {inner['code']!r}"


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """Every HTTP error body is {"error": {message, type, param, code}}; a chat or completions
    stream ends with [DONE] and its error events have that shape; a Responses stream ends with
    its final event and its `error` events carry message, code and param (OpenAI's shapes)."""
    content_type = (response.headers.get("content-type") or [""])[0]
    if case.path.startswith("/v1/messages"):  # Anthropic's shapes
        if response.status_code >= 400:
            body = json.loads(response.content)
            assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
            assert isinstance(body["error"].get("message"), str) and body["error"]["message"], body
            assert isinstance(body["error"].get("type"), str), body
        elif content_type.startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in response.content.decode().splitlines()
                      if line.startswith("data: ")]
            assert events and events[-1]["type"] in ("message_stop", "error"), f"stream ends with {events[-1:]}"
        return
    if response.status_code >= 400:
        _check_error(json.loads(response.content), f"HTTP {response.status_code}")
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in response.content.decode().splitlines() if line.startswith("data: ")]
        if case.path == "/v1/responses":
            bodies = [json.loads(e) for e in events]
            assert bodies and bodies[-1]["type"] in ("response.completed", "response.failed",
                                                     "response.incomplete"), f"stream ends with {bodies[-1:]}"
            for body in bodies:
                if body["type"] == "error":
                    assert isinstance(body["message"], str) and body["message"], body
                    assert {"code", "param"} <= set(body), body
            return
        assert events and events[-1] == "[DONE]", "a stream must end with data: [DONE]"
        for event in events[:-1]:
            body = json.loads(event)
            if "error" in body:
                _check_error(body, "SSE error event")



@schemathesis.hook
def map_case(context, case):
    """Three in four valid bodies with a `model` name the served one, and their chat messages
    get a content where they have none (SmolLM2's template needs one), so that generation itself
    is fuzzed, not only the model lookup. A schema-violating body is left as generated: it must
    stay invalid."""
    body = case.body
    if (SERVED_MODEL and isinstance(body, dict) and "model" in body and not case.meta.generation.mode.is_negative
            and zlib.crc32(repr(sorted(body.items(), key=str)).encode()) % 4):
        body["model"] = SERVED_MODEL
        for message in body.get("messages") or ():
            if isinstance(message, dict):
                message.setdefault("content", "hi")
    return case

"""The health check's payload: the small request a worker's canary sends through its own request path
(turbine/vllm/canary.py, the mocker's canary) whenever /health is asked and no real request finished
lately, and once at start.

By default, per role: one token (`max_tokens` 1, greedy) after the tokenizer's BOS token (1 when the
tokenizer has none), as Dynamo's vLLM backend sends; a text-mode worker (--use-vllm-tokenizer) gets
the text "Test"; a pooling worker embeds the BOS token. `--health-check-payload` (env
TURBINE_HEALTH_CHECK_PAYLOAD), JSON or `@file`, replaces it: a GenerateRequest's fields (`token_ids`,
`text`, `sampling`, `stop`, ...) for generating workers, an EmbedRequest's (`inputs`) for pooling
workers; `request_id` and `model` are the worker's. A payload that is not a JSON object of those fields
stops the worker (exit 2, naming the flag); one the engine refuses makes /health answer 503 naming why."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from turbine.protocol.embed import EmbedRequest
from turbine.protocol.generate import GenerateRequest, StopConditions, TextInput, SamplingOptions

FLAG = "--health-check-payload"
ENV = "TURBINE_HEALTH_CHECK_PAYLOAD"
DEFAULT_BOS = 1  # a tokenizer without a BOS token: Dynamo's choice
TEXT_PROMPT = "Test"
_FILLED = ("request_id", "model")  # the worker's own
_GENERATE_FIELDS = frozenset(GenerateRequest.__struct_fields__) - {*_FILLED, "v"}
_EMBED_FIELDS = frozenset(EmbedRequest.__struct_fields__) - {*_FILLED, "v"}


class PayloadError(ValueError):
    """The payload cannot be a request of this worker."""


def read_payload(value: str | None) -> dict[str, Any] | None:
    """The flag's value (JSON, or @path to a file of JSON) as a JSON object; None when unset.
    PayloadError naming what is wrong."""
    if value is None or not value.strip():
        return None
    text = value
    if value.startswith("@"):
        try:
            with open(value[1:]) as f:
                text = f.read()
        except OSError as exc:
            raise PayloadError(f"{value}: cannot read it: {exc.strerror or exc}") from None
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise PayloadError(f"not valid JSON: {exc}") from None
    check_payload(payload)
    return payload


def check_payload(payload: Any) -> None:
    """PayloadError unless `payload` is a JSON object of request fields."""
    if not isinstance(payload, dict):
        raise PayloadError("must be a JSON object (a request's fields)")
    for name in _FILLED:
        if name in payload:
            raise PayloadError(f"{name!r} is the worker's own; leave it out")
    unknown = sorted(set(payload) - (_GENERATE_FIELDS | _EMBED_FIELDS))
    if unknown:
        raise PayloadError(f"unknown field(s) {', '.join(unknown)}: a generating worker takes "
                           f"{', '.join(sorted(_GENERATE_FIELDS))}; a pooling worker takes "
                           f"{', '.join(sorted(_EMBED_FIELDS))}")


def bos_token_id(tokenizer) -> int:
    """The tokenizer's BOS token id (DEFAULT_BOS when it has none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if isinstance(bos, int) and not isinstance(bos, bool) else DEFAULT_BOS


def generate_request(payload: dict[str, Any] | None, *, bos: int, text_mode: bool, dp_rank: int | None = None,
                     model: str = "") -> GenerateRequest:
    """The canary's request: the payload's, else the default of the worker's mode. PayloadError if the
    payload is no GenerateRequest."""
    request_id = f"canary-{uuid.uuid4().hex[:8]}"
    if payload is None:
        sampling, stop = SamplingOptions(temperature=0.0), StopConditions(max_tokens=1)
        if text_mode:
            return GenerateRequest(request_id=request_id, model=model, token_ids=[], text=TextInput(prompt=TEXT_PROMPT),
                                   sampling=sampling, stop=stop, dp_rank=dp_rank)
        return GenerateRequest(request_id=request_id, model=model, token_ids=[bos], sampling=sampling, stop=stop,
                               dp_rank=dp_rank)
    extra = sorted(set(payload) - _GENERATE_FIELDS)
    if extra:
        raise PayloadError(f"{', '.join(extra)}: not a field of a generate request (this worker generates)")
    fields = {"token_ids": [], **payload, "request_id": request_id, "model": model}
    if dp_rank is not None and "dp_rank" not in payload:
        fields["dp_rank"] = dp_rank
    try:
        return msgspec.convert(fields, GenerateRequest)
    except msgspec.ValidationError as exc:
        raise PayloadError(str(exc)) from None


def embed_request(payload: dict[str, Any] | None, *, bos: int, model: str = "") -> EmbedRequest:
    """The canary's embed request: the payload's, else the BOS token embedded."""
    request_id = f"canary-{uuid.uuid4().hex[:8]}"
    if payload is None:
        return EmbedRequest(request_id=request_id, model=model, inputs=[[bos]])
    extra = sorted(set(payload) - _EMBED_FIELDS)
    if extra:
        raise PayloadError(f"{', '.join(extra)}: not a field of an embed request (this worker pools: give inputs)")
    try:
        return msgspec.convert({**payload, "request_id": request_id, "model": model}, EmbedRequest)
    except msgspec.ValidationError as exc:
        raise PayloadError(str(exc)) from None

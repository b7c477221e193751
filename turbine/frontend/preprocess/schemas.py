"""OpenAI request bodies as msgspec structs, and the checks vLLM would otherwise make
deep inside the engine — done here so bad input gets a 400 naming the parameter."""

from __future__ import annotations

import functools
import logging
import re
from typing import Annotated, Any

import msgspec

from turbine.frontend.errors import RequestError
from turbine.frontend.preprocess.structured import ConstraintFields

log = logging.getLogger("turbine.frontend")


# forbid_unknown_fields: a field we do not implement is a 400 naming it, never silently dropped
# (the frontend's --ignore-unknown-fields drops them instead, with a warning per field name).
class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (needs include_usage)


class _SamplingFields(ConstraintFields, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # the end user's id: written in the frontend's per-request debug log
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_embeds: Any = None  # refused: a completions-only field


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[int] | a batch of one (list[str] / list[list[int]]); checked in validate_completion
    prompt: str | list[Any] | None = None  # may be left out (or "") when prompt_embeds is given
    # base64 of a torch.save'd (sequence x hidden) tensor; checked in turbine/frontend/preprocess/prompt_embeds.py
    prompt_embeds: Any = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


_PATH = re.compile(r"at `\$\.?([^`\[]*)")
_MISSING = re.compile(r"missing required field `([^`]+)`")


_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_warned_unknown: set[str] = set()


# POST /v1/responses (turbine/frontend/apis/responses.py checks and converts it; unknown fields are refused there,
# by name, before it is converted to this struct).
class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # as `user`: logged, does not change generation
    store: bool | None = None  # None: true when this frontend has a response store
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None  # a conversation id, or {"id": ...}
    include: list[str] | None = None
    top_logprobs: int | None = None  # with include message.output_text.logprobs
    background: bool | None = None
    truncation: str | None = None  # "disabled" (what this server does); "auto" refused
    service_tier: str | None = None  # "auto" / "default" (the only tier here)
    stream_options: dict[str, Any] | None = None  # {include_obfuscation: false}


def decode_request(body: bytes, kind: type[msgspec.Struct], ignore_unknown_fields: bool = False):
    """The request struct. An unknown field is a 400 naming it, or (`ignore_unknown_fields`)
    dropped with one warning per field name; decoding stays strict and fast for known bodies."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        unknown = _UNKNOWN.search(str(exc))
        if unknown:
            name = f"{unknown.group(2)}.{unknown.group(1)}" if unknown.group(2) else unknown.group(1)
            if ignore_unknown_fields:
                return _decode_dropping_unknown(body, kind)
            raise RequestError(f"unknown or unsupported field: {name!r} (this server does not implement it)",
                               param=name) from None
        raise invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    except RecursionError:  # JSON nested deeper than the decoder's stack allows (found by fuzzing: was a 500)
        raise RequestError(TOO_DEEP) from None


TOO_DEEP = "malformed JSON body: nested too deeply"


def json_object(body: bytes) -> dict:
    """The body as a JSON object, untyped (a 400 if it is not one)."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise RequestError(TOO_DEEP) from None
    if not isinstance(raw, dict):
        raise RequestError("the request body must be a JSON object")
    return raw


def _decode_dropping_unknown(body: bytes, kind: type[msgspec.Struct]):
    raw = json_object(body)
    _drop_unknown(raw, _type_info(kind), "")
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: msgspec.ValidationError, prefix: str = "") -> RequestError:
    """A 400 for msgspec's error, naming the field at its path (under `prefix`: where the client
    sent the object that was converted)."""
    match = _PATH.search(str(exc)) or _MISSING.search(str(exc))
    param = match.group(1) if match and match.group(1) else None
    if prefix:
        param = f"{prefix}.{param}" if param else prefix
        return RequestError(f"{param}: {exc}", param=param)
    return RequestError(f"invalid request: {exc}", param=param)


@functools.cache
def _type_info(kind: type[msgspec.Struct]) -> msgspec.inspect.StructType:
    return msgspec.inspect.type_info(kind)  # slow (~1 ms): once per request kind


def _drop_unknown(raw: dict, info: msgspec.inspect.StructType, prefix: str) -> None:
    fields = {f.encode_name: f for f in info.fields}
    for key in list(raw):
        field = fields.get(key)
        if field is None:
            del raw[key]
            name = prefix + str(key)
            if name not in _warned_unknown:  # once per field name, not once per request
                _warned_unknown.add(name)
                log.warning("ignoring the unknown request field %r (--ignore-unknown-fields)", name)
            continue
        types = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for t in types:
            if isinstance(t, msgspec.inspect.StructType) and isinstance(raw[key], dict):
                _drop_unknown(raw[key], t, f"{prefix}{key}.")


MAX_N = 16
LOGIT_BIAS_LIMIT = 100.0
MAX_TOP_LOGPROBS = 20


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise RequestError(f"{param}: {message}", param=param)


def validate_sampling(req: _SamplingFields) -> None:
    if req.temperature is not None:
        _check(0.0 <= req.temperature <= 2.0, "temperature", "must be between 0 and 2")
    if req.top_p is not None:
        _check(0.0 < req.top_p <= 1.0, "top_p", "must be in (0, 1]")
    if req.top_k is not None:
        _check(req.top_k == -1 or req.top_k >= 0, "top_k", "must be -1 (disabled) or >= 0")
    if req.min_p is not None:
        _check(0.0 <= req.min_p <= 1.0, "min_p", "must be between 0 and 1")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            _check(-2.0 <= value <= 2.0, name, "must be between -2 and 2")
    if req.repetition_penalty is not None:
        _check(0.0 < req.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
    if req.seed is not None:
        _check(-(2**63) <= req.seed < 2**63, "seed", "must fit in 64 bits")
    _check(1 <= req.n <= MAX_N, "n", f"must be between 1 and {MAX_N}")
    if req.min_tokens is not None:
        _check(req.min_tokens >= 0, "min_tokens", "must be >= 0")
    if isinstance(req.stop, list):
        _check(all(req.stop), "stop", "stop strings must not be empty")
    elif req.stop is not None:
        _check(bool(req.stop), "stop", "stop string must not be empty")
    if req.stop_token_ids is not None:
        _check(all(t >= 0 for t in req.stop_token_ids), "stop_token_ids", "token ids must be >= 0")
    if req.stream_options is not None:
        _check(req.stream, "stream_options", "is only allowed when stream is true")
        _check(req.stream_options.include_usage or not req.stream_options.continuous_usage_stats,
               "stream_options.continuous_usage_stats", "requires stream_options.include_usage to be true")


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) as token ids, checked against the vocabulary
    (vocab_size None: text mode, the engine checks them)."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        _check(key.isdigit() and (vocab_size is None or int(key) < vocab_size), "logit_bias",
               f"{key!r} is not a token id of the model" + (f" (0..{vocab_size - 1})" if vocab_size else ""))
        _check(-LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT, "logit_bias",
               f"the bias of token {key} must be between -100 and 100")
        out[int(key)] = float(value)
    return out


def validate_chat(req: ChatCompletionRequest) -> None:
    validate_sampling(req)
    _check(bool(req.messages), "messages", "must contain at least one message")
    for i, msg in enumerate(req.messages):
        _check(isinstance(msg.get("role"), str), f"messages[{i}].role", "is required and must be a string")
        content = msg.get("content")
        _check(content is None or isinstance(content, (str, list)), f"messages[{i}].content",
               "must be a string or a list of content parts")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None:
            _check(value >= 1, name, "must be >= 1")
    if req.top_logprobs is not None:
        _check(0 <= req.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be between 0 and {MAX_TOP_LOGPROBS}")
        _check(req.logprobs, "top_logprobs", "requires logprobs to be true")
    _check(req.prompt_embeds is None, "prompt_embeds", "chat completions do not take prompt embeddings; "
           "send them to /v1/completions")


def validate_completion(req: CompletionRequest) -> list[str | list[int]]:
    """Checks the request; returns its prompts (prompts_of; none when it gives prompt embeddings)."""
    validate_sampling(req)
    if req.max_tokens is not None:
        _check(req.max_tokens >= 1, "max_tokens", "must be >= 1")
    if req.logprobs is not None:
        _check(0 <= req.logprobs <= MAX_TOP_LOGPROBS, "logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
    # None of the models served here has fill-in-the-middle tokens (SmolLM2 has none).
    _check(req.suffix is None, "suffix", "is not supported: no fill-in-the-middle template for this model")
    if req.prompt_embeds is None:
        return prompts_of(req)
    _check(not req.prompt, "prompt", "give either prompt or prompt_embeds, not both (prompt may be \"\")")
    _check(not req.echo, "echo", "cannot echo a prompt given as embeddings")
    return []


MAX_BATCH_PROMPTS = 64
# A token-id prompt's check in C (msgspec refuses bools, floats and negatives): a Python loop over its ids was a third
# of the frontend's CPU at 4,096-token prompts (py-spy; 188 -> 18 us a prompt, timeit).
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, each text or token ids: one, or a batch (a list of
    strings or of token-id lists)."""
    prompt = req.prompt
    _check(prompt is not None, "prompt", "is required")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check(len(prompt) <= MAX_BATCH_PROMPTS, "prompt", f"a batch holds at most {MAX_BATCH_PROMPTS} prompts")
        _check(len(prompt) * req.n <= MAX_BATCH_PROMPTS, "n",
               f"prompts x n must be at most {MAX_BATCH_PROMPTS}")
        prompts = list(prompt)
    else:
        prompts = [prompt]
    for p in prompts:
        _check(isinstance(p, type(prompts[0])), "prompt", "a batch is a list of strings or of token-id lists")
        _check(len(p) > 0, "prompt", "must not be empty")
        if isinstance(p, list):
            try:
                msgspec.convert(p, _TOKEN_IDS)
            except msgspec.ValidationError:
                _check(False, "prompt", "must be a string or a list of non-negative token ids")
    return prompts


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

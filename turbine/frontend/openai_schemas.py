"""OpenAI request bodies as msgspec structs, and the checks vLLM would otherwise make
deep inside the engine — done here so bad input gets a 400 naming the parameter."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from turbine.frontend.errors import RequestError
from turbine.frontend.structured import ConstraintFields


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(ConstraintFields, kw_only=True):
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
    user: str | None = None
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
    # base64 of a torch.save'd (sequence x hidden) tensor; checked in turbine/frontend/prompt_embeds.py
    prompt_embeds: Any = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


_PATH = re.compile(r"at `\$\.?([^`\[]*)")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc)) or _MISSING.search(str(exc))
        param = match.group(1) if match and match.group(1) else None
        raise RequestError(f"invalid request: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None


MAX_N = 16
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


def validate_completion(req: CompletionRequest) -> None:
    validate_sampling(req)
    if req.max_tokens is not None:
        _check(req.max_tokens >= 1, "max_tokens", "must be >= 1")
    if req.logprobs is not None:
        _check(0 <= req.logprobs <= MAX_TOP_LOGPROBS, "logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
    _check(not req.echo, "echo", "is not supported")
    _check(req.suffix is None, "suffix", "is not supported")
    if req.prompt_embeds is None:
        prompt_of(req)
    else:
        _check(not req.prompt, "prompt", "give either prompt or prompt_embeds, not both (prompt may be \"\")")


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request: text or token ids."""
    prompt = req.prompt
    _check(prompt is not None, "prompt", "is required")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check(len(prompt) == 1, "prompt", "batched prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    _check(len(prompt) > 0, "prompt", "must not be empty")
    if isinstance(prompt, list):
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt), "prompt",
               "must be a string or a list of non-negative token ids")
    return prompt


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

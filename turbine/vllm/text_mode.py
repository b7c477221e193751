"""Text mode (--use-vllm-tokenizer): the request carries text, which this worker renders with
vLLM's own chat template and tokenizes with the engine's tokenizer; the engine detokenizes and
applies stop strings, and the worker streams text deltas back (GenerateOutput.text)."""

from __future__ import annotations

import msgspec
from vllm.exceptions import VLLMValidationError
from vllm.renderers.params import ChatParams

from turbine.protocol.generate import GenerateRequest, TextInput
from turbine.runtime.errors import InvalidRequest

TEXT_MODE_LOGPROBS = "logprobs are not supported in text mode (--use-vllm-tokenizer)"


async def prompt_token_ids(engine, req: GenerateRequest, chat_template: str | None = None) -> list[int]:
    """The prompt's token ids: chat messages rendered by the engine's renderer (vLLM's chat
    template handling, as `vllm serve` does; `chat_template`: the --custom-jinja-template's text,
    else the model's), the completion prompt encoded with special tokens, or else the request's
    token ids."""
    text = req.text
    if text.prompt is not None and text.messages is not None:
        raise InvalidRequest("text: give one of prompt and messages, not both")
    if text.prompt is None and text.messages is None:
        return req.token_ids
    if req.token_ids:
        raise InvalidRequest("text: token_ids and a text prompt both given")
    if text.prompt is not None:
        return engine.get_tokenizer().encode(text.prompt, add_special_tokens=True)
    kwargs = dict(text.chat_template_kwargs or {})
    kwargs.update(add_generation_prompt=text.add_generation_prompt, tools=text.tools, tokenize=True)
    params = ChatParams(chat_template=chat_template, chat_template_kwargs=kwargs)
    try:
        _, prompt = await engine.renderer.render_messages_async(text.messages, params)
    except (VLLMValidationError, ValueError, TypeError, KeyError) as exc:
        raise InvalidRequest(f"messages: cannot apply the chat template: {exc}") from None
    return list(prompt["prompt_token_ids"])


def text_request(req: GenerateRequest, token_ids: list[int], max_model_len: int) -> GenerateRequest:
    """The request with its rendered prompt, checked against the context length (the frontend,
    without a tokenizer, cannot)."""
    if req.output.logprobs is not None:
        raise InvalidRequest(TEXT_MODE_LOGPROBS)
    max_tokens = req.stop.max_tokens
    if max_tokens is not None and len(token_ids) < max_model_len < len(token_ids) + max_tokens:
        raise InvalidRequest(f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}, "
                             f"{len(token_ids) + max_tokens} in all, over the model's context length of "
                             f"{max_model_len}")
    if req.stop.min_tokens is not None and max_tokens is not None and req.stop.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({req.stop.min_tokens}) is larger than max_tokens ({max_tokens})")
    return msgspec.structs.replace(req, token_ids=token_ids)


def text_sampling_kwargs(text: TextInput, kwargs: dict) -> dict:
    """The engine detokenizes (incrementally) and stops on the stop strings itself."""
    kwargs["detokenize"] = True
    kwargs["skip_special_tokens"] = text.skip_special_tokens
    kwargs["include_stop_str_in_output"] = text.include_stop_str_in_output
    if text.stop:
        kwargs["stop"] = list(text.stop)
    return kwargs

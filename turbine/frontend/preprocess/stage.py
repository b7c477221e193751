"""The preprocess stage: an OpenAI request body -> a Prepared request (the worker's token-in
GenerateRequest plus what the later stages need). Decoding and validation, the model lookup,
the chat template, tokenization and the context-length limits happen here; new input kinds
(token ids, embeddings, media) plug in here too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turbine.frontend.deltas import OutputSpec
from turbine.frontend.errors import ModelAsleep, RequestError
from turbine.frontend.models.table import ModelTable, ServedModel
from turbine.frontend.preprocess import tools
from turbine.frontend.preprocess.media import MediaConfig, load_images, refuse_media, split_media
from turbine.frontend.preprocess.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    logit_bias_of,
    stop_list,
    validate_chat,
    validate_completion,
)
from turbine.frontend.preprocess.prompt_embeds import DEFAULT_MAX_PROMPT_EMBEDS_BYTES, prompt_embeds_payload
from turbine.frontend.preprocess.structured import Constraint, constraint_of
from turbine.frontend.preprocess.text_mode import text_input
from turbine.frontend.request_id import worker_request_id
from turbine.protocol.generate import GenerateRequest, OutputOptions, SamplingOptions, StopConditions

Kind = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class Prepared:
    kind: Kind
    model: ServedModel
    request: GenerateRequest
    output: OutputSpec
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage
    # The request field its output constraint came from: a worker's error about the constraint names it.
    constraint_param: str | None = None
    continuous_usage: bool = False  # streaming: the usage so far on every chunk
    echo: str | None = None  # completions: the prompt text, written before the output
    user: str | None = None  # the client's end-user id (logged)


async def preprocess(body: bytes, kind: Kind, models: ModelTable, ignore_unknown_fields: bool = False,
                     max_prompt_embeds_bytes: int = DEFAULT_MAX_PROMPT_EMBEDS_BYTES,
                     media: MediaConfig = MediaConfig()) -> Prepared:
    """One prompt's request; a batch of completion prompts is refused here (see preprocess_all)."""
    prepared = await preprocess_all(body, kind, models, ignore_unknown_fields, max_prompt_embeds_bytes, media)
    if len(prepared) > 1:
        raise RequestError("a batch of prompts is not accepted here", param="prompt")
    return prepared[0]


async def preprocess_all(body: bytes, kind: Kind, models: ModelTable, ignore_unknown_fields: bool = False,
                         max_prompt_embeds_bytes: int = DEFAULT_MAX_PROMPT_EMBEDS_BYTES,
                         media: MediaConfig = MediaConfig()) -> list[Prepared]:
    """The request's prompts, each prepared (a completions batch has several, chat one).
    Raises RequestError (naming the parameter) for anything the request gets wrong."""
    if kind == "chat":
        return [await preprocess_chat(decode_request(body, ChatCompletionRequest, ignore_unknown_fields), models,
                                      media)]
    req = decode_request(body, CompletionRequest, ignore_unknown_fields)
    prompts = validate_completion(req)  # the prompts it checked: each read once
    constraint = constraint_of(req)
    model = served_model(models, req.model, kind)
    if req.prompt_embeds is not None:
        return [await _prepare(req, kind, model, None, constraint, max_prompt_embeds_bytes, media)]
    return [await _prepare(req, kind, model, prompt, constraint, max_prompt_embeds_bytes, media)
            for prompt in prompts]


async def preprocess_chat(req: ChatCompletionRequest, models: ModelTable,
                          media: MediaConfig = MediaConfig()) -> Prepared:
    """A chat request struct, decoded from a chat body or built by another API (Responses), checked
    (validate_chat: ranges and limits, as for a decoded body) and prepared."""
    validate_chat(req)
    constraint = constraint_of(req)
    model = served_model(models, req.model, "chat")
    return await _prepare(req, "chat", model, None, constraint, DEFAULT_MAX_PROMPT_EMBEDS_BYTES, media)


async def _prepare(req, kind: Kind, model: ServedModel, prompt: str | list[int] | None, constraint: Constraint | None,
                   max_prompt_embeds_bytes: int, media: MediaConfig = MediaConfig()) -> Prepared:
    tok = model.tokenizer
    text_in = None
    plan = tools.OutputPlan()
    if kind == "chat":  # (text mode: the worker renders tool calls with vLLM's template)
        plan = tools.plan(req, model.card, tok.renders_tool_calls if tok is not None else True)
    if plan.structured_outputs is not None and constraint is not None:
        raise RequestError(f"tool_choice {req.tool_choice!r} forces a tool call, which cannot be combined with "
                           f"{constraint.param}: both constrain the whole output", param="tool_choice")
    embeds: bytes | None = None  # a prompt given as embeddings (completions only)
    images = None  # a chat's images (checked, hashed), in prompt order
    if tok is None:  # text mode: the worker renders, tokenizes and checks the lengths
        if kind == "completions" and req.prompt_embeds is not None:
            raise RequestError(f"prompt_embeds: the model {model.name!r} is served in text mode "
                               "(--use-vllm-tokenizer) and takes no prompt embeddings", param="prompt_embeds")
        if kind == "chat":  # the worker would render (and vLLM fetch) media parts unchecked
            refuse_media(model.name, split_media(req.messages)[1], "it is served in text mode (--use-vllm-tokenizer)")
        text_in, token_ids = text_input(req, model.name, prompt)
        logprobs = None
        max_tokens = req.max_completion_tokens if kind == "chat" and req.max_completion_tokens is not None \
            else req.max_tokens
    elif kind == "chat":
        messages, urls = split_media(plan.messages)
        if urls:
            if not all(card.multimodal for card in (model.cards.values() or [model.card])):
                refuse_media(model.name, urls, "its workers run without --enable-multimodal")
            images = await load_images(urls, media)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools, **(req.chat_template_kwargs or {}))
        except ValueError as exc:
            raise RequestError(f"cannot apply the chat template: {exc}", param="messages") from None
        # The template writes BOS and friends itself: no post-processor on top.
        token_ids = await tok.encode_off_loop(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_param = "messages"
    elif req.prompt_embeds is not None:
        # The worker knows the sequence length (and checks it); the prompt has no token ids.
        embeds = await prompt_embeds_payload(req.prompt_embeds, model, max_prompt_embeds_bytes)
        token_ids = []
        max_tokens = req.max_tokens
        logprobs = req.logprobs
        prompt_param = "prompt_embeds"
    else:
        token_ids = await tok.encode_off_loop(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        if isinstance(prompt, list) and max(prompt) >= tok.vocab_size:
            raise RequestError(f"prompt: token id {max(prompt)} is outside the vocabulary (size {tok.vocab_size})",
                               param="prompt")
        max_tokens = req.max_tokens
        logprobs = req.logprobs
        prompt_param = "prompt"
    if tok is not None and (image_token := model.card.image_token_id) is not None \
            and (placed := token_ids.count(image_token)) != len(images or ()):
        # The engine pairs images with image tokens in order: a template that drops or repeats them, or a text
        # (or token-id prompt) that spells the token, would give it a prompt it cannot fill.
        raise RequestError(f"the prompt holds {placed} image tokens for {len(images or ())} images (the chat "
                           "template places one per image_url part; the text may not contain the image token)",
                           param=prompt_param)
    if tok is not None and embeds is None:
        max_tokens = _checked_lengths(_engine_prompt_length(token_ids, images, model.card), max_tokens,
                                      model.card.context_length, prompt_param)
    elif embeds is not None and max_tokens is not None and max_tokens >= model.card.context_length:
        raise RequestError(f"max_tokens ({max_tokens}) leaves no room for the prompt in the model's context length "
                           f"of {model.card.context_length}", param="max_tokens")
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})",
                           param="min_tokens")
    if tok is not None and req.stop_token_ids and max(req.stop_token_ids) >= tok.vocab_size:
        raise RequestError("stop_token_ids: token id outside the vocabulary", param="stop_token_ids")
    logit_bias = logit_bias_of(req.logit_bias, tok.vocab_size if tok is not None else None)
    request = GenerateRequest(
        request_id=worker_request_id(),  # the HTTP request's id (request_id.py)
        model=model.name,
        token_ids=token_ids,
        sampling=SamplingOptions(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=logit_bias),
        stop=StopConditions(max_tokens=max_tokens, min_tokens=req.min_tokens,
                            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos),
        output=OutputOptions(logprobs=logprobs,
                             prompt_logprobs=logprobs if kind == "completions" and req.echo else None),
        text=text_in,
        structured_outputs=plan.structured_outputs or (constraint.outputs if constraint else None),
        prompt_embeds=embeds,
        images=images or None,
        lora_name=model.lora_name,
    )
    output = OutputSpec(stop=stop_list(req.stop), include_stop_str_in_output=req.include_stop_str_in_output,
                        # the parsers' markers may be special tokens
                        skip_special_tokens=req.skip_special_tokens and not plan.keep_special_tokens,
                        parsers=plan.parsers)
    opts = req.stream_options
    echo = None
    if kind == "completions" and req.echo:
        echo = prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special_tokens=False)
    return Prepared(kind, model, request, output, stream=req.stream,
                    include_usage=bool(opts and opts.include_usage),
                    continuous_usage=bool(opts and opts.continuous_usage_stats), echo=echo, user=req.user,
                    constraint_param="tool_choice" if plan.structured_outputs else
                    (constraint.param if constraint else None))


def served_model(models: ModelTable, name: str, kind: Kind) -> ServedModel:
    model = models.models.get(name)
    if model is None or not model.instances:
        if name in models.asleep:
            raise ModelAsleep(name)
        raise RequestError(f"the model {name!r} does not exist or has no live worker", param="model",
                           status=404, code="model_not_found")
    if kind not in model.card.endpoint_types:
        raise RequestError(f"the model {name!r} does not serve {kind} requests", param="model")
    return model


def _engine_prompt_length(token_ids: list[int], images, card) -> int:
    """The prompt's length as the engine holds it: each image token widens to the image's placeholder, where the
    card says what that is (the worker measures it at start; unknown, e.g. a placeholder sized by the picture: the
    unwidened length, and the engine ends a longer answer at the context length)."""
    if images and card.image_placeholder is not None:
        return len(token_ids) + len(images) * (len(card.image_placeholder) - 1)
    return len(token_ids)


def _checked_lengths(prompt_tokens: int, max_tokens: int | None, context: int, prompt_param: str) -> int:
    """max_tokens, defaulted to what the context leaves; a prompt or total over the context is an error."""
    if prompt_tokens >= context:
        raise RequestError(f"the prompt has {prompt_tokens} tokens but the model's context length is {context}",
                           param=prompt_param)
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise RequestError(f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                           f"{prompt_tokens + max_tokens} in all, over the model's context length of {context}",
                           param="max_tokens")
    return max_tokens

"""The token-in/token-out `generate` contract between frontend and workers.

The frontend tokenizes, applies templates and handles stop strings; workers see only
token ids and sampling options. Text mode (`GenerateRequest.text`) is the exception: for a
model whose card says `model_input: "text"` the worker renders, tokenizes and detokenizes.
Unknown fields are ignored (forward compatibility); missing required fields fail decoding
with a clear msgspec error.
"""

from __future__ import annotations

from typing import Any

import msgspec

WIRE_VERSION = 1


class SamplingOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias, ids checked).
    logit_bias: dict[int, float] | None = None


class StopConditions(msgspec.Struct, omit_defaults=True, kw_only=True):
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class OutputOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    # Number of top logprobs per sampled token; None = no logprobs at all.
    logprobs: int | None = None
    # Number of top logprobs per prompt token; None = the prompt's logprobs are not computed
    # (completions' echo with logprobs).
    prompt_logprobs: int | None = None


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the output for the engine's structured-output backend: exactly one of
    these is set (the frontend builds it from response_format, the guided_* fields or a forced
    tool call)."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF or Lark
    disable_any_whitespace: bool = False


class TextInput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Text mode (a worker started with --use-vllm-tokenizer): the prompt as text, which the
    worker renders and tokenizes with the engine's own tokenizer; it returns text, with stop
    strings applied by the engine. At most one of `prompt` (completions) and `messages` (chat);
    neither: the prompt is GenerateRequest.token_ids (a completion prompt given as token ids)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class ImagePixels(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A decoded image as a typed array: `dtype` (always "uint8") and `shape` ([height, width, 3], RGB) say
    how to read `data`, its raw bytes in row-major order (never a pickle)."""

    dtype: str
    shape: list[int]
    data: bytes


class ImageInput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One image of a chat prompt (a worker with --enable-multimodal): the file as the client sent or
    served it, which the frontend decoded (PNG, JPEG or WebP, within its pixel bound), and the SHA-256 of its
    decoded RGB pixels (the engine's identifier for the image: its encoder and prefix caches key on it).
    With the frontend's --frontend-decoding, `pixels` (the decoded image) comes instead of `data`: the worker
    then decodes nothing. Exactly one of the two is given."""

    data: bytes = b""
    hash: str
    pixels: ImagePixels | None = None


class NixlSource(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A buffer in the encode worker's host memory, registered with its NIXL agent."""

    agent: str  # the encode worker's agent name
    metadata: bytes  # its agent metadata (nixl_agent.get_agent_metadata), for add_remote_agent
    address: int
    length: int  # bytes


class ImageEmbedding(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Where one image's embeddings are: (shape[0] placeholder tokens) x (shape[1] = the language tower's
    width) values of `dtype`, row-major. Exactly one of `path` and `nixl`."""

    hash: str  # ImageInput.hash: the engine's identifier for the image
    dtype: str
    shape: list[int]
    path: str | None = None  # file transport: a file on the encode worker's (= this) host
    nixl: NixlSource | None = None


class ImageOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """An image the request asks an omni worker's pipeline for (cards whose output_modalities has "image"):
    its size in pixels; None: the pipeline's default. The count is SamplingOptions.n."""

    width: int | None = None
    height: int | None = None


class GenerateRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    # Disaggregated serving: what a prefill worker returned, so that a decode worker pulls the
    # prompt's KV instead of computing it (the KV connector's own parameters, passed through).
    kv_transfer_params: dict[str, Any] | None = None
    # The data-parallel rank (engine) of the chosen worker that serves it, as the router decided;
    # None: the worker picks one.
    dp_rank: int | None = None
    # The LoRA adapter to generate with (None: the base model). It salts the KV router's block
    # hashes; workers refuse it until they can load adapters.
    lora_name: str | None = None
    # Constrained decoding (None: free text); the prefill worker of a disaggregated request gets
    # the same constraint as its decode worker.
    structured_outputs: StructuredOutputs | None = None
    # Text mode: the prompt as text (token_ids is then empty); None: token mode.
    text: TextInput | None = None
    # A prompt given as embeddings instead of tokens (token_ids is then empty): the bytes of a
    # torch.save'd 2-D tensor (sequence x hidden size), as the client sent them. Only workers whose
    # card says `accepts_prompt_embeds` take it; they load it with torch's weights-only loader.
    prompt_embeds: bytes | None = None
    # The prompt's images, in the order of their placeholders in token_ids (the chat template's image
    # token, which the engine widens to the image's tokens). Only workers whose card says `multimodal`.
    images: list[ImageInput] | None = None
    # Disaggregated encode (turbine/protocol/encode.py): where an encode worker put each image's embeddings,
    # one per image in order; the worker's engine loads them instead of running its vision encoder (cards
    # that say `takes_image_embeddings`). The images still come: the engine's processor sizes their placeholders.
    image_embeddings: list[ImageEmbedding] | None = None
    # An omni worker's image output (/v1/images/generations, or a chat with an image-output model): the
    # pipeline answers with images (GenerateOutput.images) rather than text.
    image: ImageOptions | None = None
    v: int = WIRE_VERSION


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class Usage(msgspec.Struct, omit_defaults=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None


class GenerateOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One chunk of a generate stream: only the tokens new since the previous chunk."""

    token_ids: list[int]
    index: int = 0  # choice index when n > 1
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    # "stop" | "length"; None while streaming. A failed request ends with an ERROR frame
    # carrying a turbine.protocol.errors.WorkerError instead.
    finish_reason: str | None = None
    # The first chunk of a request that asked for prompt_logprobs: per prompt token its logprob
    # (None for the first, which has no context) and its top alternatives.
    prompt_log_probs: list[float | None] | None = None
    prompt_top_logprobs: list[list[TopLogprob]] | None = None
    # The stop token id that ended the sequence, if any.
    stop_reason: int | None = None
    usage: Usage | None = None  # last chunk of a choice only
    # A prefill worker's last chunk: where the decode worker finds the prompt's KV.
    kv_transfer_params: dict[str, Any] | None = None
    # Text mode: the text new since the previous chunk (stop strings already applied).
    text: str | None = None
    # An omni worker's image outputs: PNG files (the choice's last chunk).
    images: list[bytes] | None = None
    v: int = WIRE_VERSION


class ClearKvBlocksRequest(msgspec.Struct, kw_only=True):
    v: int = WIRE_VERSION


class StatusReply(msgspec.Struct, kw_only=True):
    status: str  # "success" | "error"
    message: str = ""
    v: int = WIRE_VERSION

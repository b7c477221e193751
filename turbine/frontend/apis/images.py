"""Image outputs of omni workers whose pipeline answers with images (their card's `output_modalities` has "image"):

- `POST /v1/images/generations` (OpenAI's shape): the prompt goes to one such worker as a text-mode generate request
  asking for `n` images of `size` (GenerateRequest.image); the PNGs it returns are written as
  `{"created", "data": [{"b64_json"}]}`. Only `response_format: b64_json`: this server keeps no files to link to.
- `/v1/chat/completions` for a model that answers with images only: the chat's text (preprocessed as any text-mode
  chat) goes out the same way, and the answer's message content is a list of `image_url` parts with `data:` URLs
  (streamed: one chunk holding them, then the finish)."""

from __future__ import annotations

import asyncio
import base64
import re
import time

import msgspec

from turbine.frontend.dispatch.stage import on_some_worker
from turbine.frontend.errors import RequestError, failure_of
from turbine.frontend.models.table import ModelTable, ServedModel
from turbine.frontend.preprocess.schemas import decode_request
from turbine.frontend.request_id import worker_request_id
from turbine.protocol.generate import GenerateOutput, GenerateRequest, ImageOptions, SamplingOptions, TextInput
from turbine.router.policy import Target
from turbine.runtime.errors import ConnectFailed, PeerDisconnected, RemoteError

IMAGE = "image"
MAX_N = 10  # as OpenAI's API
MAX_SIDE = 4096
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class ImageGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the pipeline's default)
    response_format: str = "b64_json"
    seed: int | None = None  # not OpenAI's: the diffusion stages' seed, for repeatable images
    user: str | None = None


def image_size(size: str | None) -> tuple[int | None, int | None]:
    """(width, height) of `size`; (None, None): the pipeline's default. RequestError naming `size` otherwise."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.match(size)
    if match is None:
        raise RequestError(f"size: {size!r} is not WIDTHxHEIGHT (e.g. 1024x1024) or auto", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    if width > MAX_SIDE or height > MAX_SIDE:
        raise RequestError(f"size: {size!r}: each side at most {MAX_SIDE} pixels", param="size")
    return width, height


def image_model(models: ModelTable, name: str | None) -> tuple[ServedModel, list]:
    """The model and its instances whose cards say they answer with images; RequestError otherwise."""
    if name is None:
        if len(models.models) != 1:
            raise RequestError("model: required when more than one model is served", param="model")
        name = next(iter(models.models))
    model = models.models.get(name)
    if model is None or not model.instances:
        raise RequestError(f"the model {name!r} does not exist or has no live worker", param="model", status=404,
                           code="model_not_found")
    return image_model_of(model)


def answers_images_only(model: ServedModel) -> bool:
    """Whether every worker of the model answers with images and none with text (its chats get image parts)."""
    cards = list(model.cards.values()) or [model.card]
    return all(IMAGE in c.modalities and "text" not in c.modalities for c in cards)


async def _images(model: ServedModel, pool: list, request: GenerateRequest, client, metrics) -> list[bytes]:
    """The PNGs one image worker of `pool` returns for `request` (the next worker if one cannot be reached)."""
    request_id = request.request_id

    async def attempt(target: Target, attempt_request: GenerateRequest) -> list[bytes]:
        inst = target.instance
        pngs: list[bytes] = []
        try:
            async with client.stream(inst.address, inst.endpoint, attempt_request, GenerateOutput) as stream:
                async for out in stream:
                    pngs.extend(out.images or [])
        except RemoteError as exc:
            raise failure_of(exc, inst.instance_id) from exc
        finally:
            model.router.finished(request_id)
        return pngs

    try:
        pngs = await on_some_worker(
            pool, model.router, request, attempt,
            retry=lambda exc: isinstance(exc, (ConnectFailed, PeerDisconnected)),
            none_left=lambda tried: RequestError(f"no live image worker for model {model.name!r}", param="model",
                                                 status=503, type_="service_unavailable"))
    except asyncio.CancelledError:  # the client left (http.py's watch): the worker's stream was cancelled
        if metrics is not None:
            metrics.of(model.name).disconnects.inc()
        raise
    if len(pngs) != request.sampling.n:
        raise RequestError(f"the worker returned {len(pngs)} images for n={request.sampling.n}", status=502,
                           type_="worker_error")
    return pngs


async def image_chat(prepared, client, metrics=None) -> tuple[bytes, str]:
    """A chat answered with images: (the body, its media type). `prepared`: the chat's text-mode Prepared."""
    model = prepared.model
    _, pool = image_model_of(model)
    request = msgspec.structs.replace(prepared.request, image=ImageOptions())
    pngs = await _images(model, pool, request, client, metrics)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
             for p in pngs]
    head = {"id": f"chatcmpl-{request.request_id}", "created": int(time.time()), "model": model.name}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}  # an image pipeline counts no tokens
    if not prepared.stream:
        return msgspec.json.encode({**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": parts}, "finish_reason": "stop"}],
            "usage": usage}), "application/json"
    chunk = {**head, "object": "chat.completion.chunk"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": parts},
                                     "finish_reason": None}]},
              {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    if prepared.include_usage:
        events.append({**chunk, "choices": [], "usage": usage})
    body = b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return body, "text/event-stream"


def image_model_of(model: ServedModel) -> tuple[ServedModel, list]:
    pool = [rec for rec in model.instances if IMAGE in model.cards.get(rec.instance_id, model.card).modalities]
    if not pool:
        answers = " and ".join(model.card.modalities)
        raise RequestError(f"the model {model.name!r} does not generate images (its workers answer with {answers}): "
                           "/v1/images/generations needs an omni worker whose pipeline ends in an image stage",
                           param="model")
    return model, pool


async def images_generations(body: bytes, models: ModelTable, client, metrics=None) -> bytes:
    """The JSON response body; RequestError for anything wrong."""
    req = decode_request(body, ImageGenerationRequest)
    if req.response_format != "b64_json":
        raise RequestError(f"response_format: {req.response_format!r} is not supported (this server keeps no "
                           "image files to link to); use b64_json", param="response_format")
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n: must be between 1 and {MAX_N}", param="n")
    if not req.prompt:
        raise RequestError("prompt: must not be empty", param="prompt")
    width, height = image_size(req.size)
    model, pool = image_model(models, req.model)
    request = GenerateRequest(request_id=worker_request_id(), model=model.name, token_ids=[],
                              text=TextInput(prompt=req.prompt), sampling=SamplingOptions(n=req.n, seed=req.seed),
                              image=ImageOptions(width=width, height=height))
    pngs = await _images(model, pool, request, client, metrics)
    data = [{"b64_json": base64.b64encode(png).decode()} for png in pngs]
    return msgspec.json.encode({"created": int(time.time()), "data": data})

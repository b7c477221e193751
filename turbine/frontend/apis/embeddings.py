"""`POST /v1/embeddings`, for models served by pooling workers (a vLLM worker with
`--runner pooling`; its card's endpoint_types is ["embeddings"]). The body is tokenized here,
one worker embeds every input (the `embed` request-plane endpoint) and the answer is written in
OpenAI's shape: `encoding_format` "float" (a list of numbers) or "base64" (the float32
little-endian bytes, as OpenAI sends them)."""

from __future__ import annotations

import array
import asyncio
import base64
import sys
from typing import Any, Literal

import msgspec

from turbine.frontend.dispatch.stage import on_some_worker
from turbine.frontend.errors import RequestError, failure_of
from turbine.frontend.models.table import ModelTable
from turbine.frontend.preprocess.schemas import decode_request
from turbine.frontend.preprocess.stage import served_model
from turbine.frontend.request_id import worker_request_id
from turbine.protocol.embed import EMBED_ENDPOINT, EmbedOutput, EmbedRequest
from turbine.protocol.generate import GenerateRequest
from turbine.router.policy import Target
from turbine.runtime.errors import ConnectFailed, PeerDisconnected, RemoteError

MAX_INPUTS = 2048  # as OpenAI's API


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]  # a string, a list of strings, a list of token ids, a list of those
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _inputs(value: str | list[Any]) -> list[str | list[int]]:
    """The request's inputs, each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [value]
    if not value or not all(isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v)) for v in value):
        raise RequestError("input: must be a string, a list of strings, a list of token ids or a list of those",
                           param="input")
    if len(value) > MAX_INPUTS:
        raise RequestError(f"input: at most {MAX_INPUTS} inputs per request", param="input")
    return value


async def embeddings(body: bytes, models: ModelTable, client, metrics=None) -> bytes:
    """The JSON response body; RequestError for anything wrong. `metrics`: the frontend's
    FrontendMetrics (a client that leaves before the answer is counted there)."""
    req = decode_request(body, EmbeddingRequest)
    if req.dimensions is not None:
        raise RequestError("dimensions: reducing the embedding's dimensions is not supported", param="dimensions")
    model = served_model(models, req.model, "embeddings")
    tok, context = model.tokenizer, model.card.context_length
    token_lists = []
    for i, item in enumerate(_inputs(req.input)):
        ids = await tok.encode_off_loop(item, add_special_tokens=True) if isinstance(item, str) else item
        if not ids:
            raise RequestError(f"input[{i}]: is empty", param="input")
        if len(ids) > context:
            raise RequestError(f"input[{i}]: has {len(ids)} tokens; the model's context length is {context}",
                               param="input")
        if min(ids) < 0 or max(ids) >= tok.vocab_size:
            raise RequestError(f"input[{i}]: token id outside the vocabulary (size {tok.vocab_size})", param="input")
        token_lists.append(ids)
    request_id = worker_request_id()
    embed = EmbedRequest(request_id=request_id, model=model.name, inputs=token_lists)

    async def attempt(target: Target, _: GenerateRequest) -> EmbedOutput:
        inst = target.instance
        try:
            async with client.stream(inst.address, EMBED_ENDPOINT, embed, EmbedOutput) as stream:
                async for out in stream:
                    return out
        except RemoteError as exc:
            raise failure_of(exc, inst.instance_id) from exc
        finally:
            model.router.finished(request_id)
        raise RequestError(f"worker {inst.instance_id} returned no embeddings", status=502, type_="worker_error")

    # Routed on load alone (no token ids: a batch of inputs has no one prefix to follow).
    routing = GenerateRequest(request_id=request_id, model=model.name, token_ids=[])
    try:
        out = await on_some_worker(
            model.instances, model.router, routing, attempt,
            retry=lambda exc: isinstance(exc, (ConnectFailed, PeerDisconnected)),
            none_left=lambda tried: RequestError(f"no live worker for model {model.name!r}", param="model",
                                                 status=503, type_="service_unavailable"))
    except asyncio.CancelledError:  # the client left (http.py's watch): the worker's stream was cancelled
        if metrics is not None:
            metrics.of(model.name).disconnects.inc()
        raise
    if len(out.embeddings) != len(token_lists):
        raise RequestError("the worker returned a wrong number of embeddings", status=502, type_="worker_error")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vec, req.encoding_format)}
            for i, vec in enumerate(out.embeddings)]
    return msgspec.json.encode({"object": "list", "data": data, "model": model.name,
                                "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}})


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector).decode()
    floats = array.array("f", vector)
    if sys.byteorder != "little":
        floats.byteswap()
    return floats.tolist()

"""The `embed` endpoint of a pooling vLLM worker (`--runner pooling`, e.g. `--convert embed` for
a decoder model such as SmolLM2): each input's token ids through the engine's pooler, returned
as float32 bytes. Its card lists only "embeddings"; it serves no `generate`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import torch
from vllm import PoolingParams

from turbine.protocol import errors as codes
from turbine.protocol.embed import EmbedOutput, EmbedRequest
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.worker.worker_metrics import WorkerMetrics


class EmbedHandlers:
    def __init__(self, engine, metrics: WorkerMetrics, on_success=None):
        self.engine = engine
        self.metrics = metrics
        self.on_success = on_success
        model_config = engine.vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()

    def _check(self, req: EmbedRequest) -> None:
        """InvalidRequest unless every input can be embedded here."""
        if not req.inputs or not all(req.inputs):
            raise InvalidRequest("input: every input must have at least one token")
        for ids in req.inputs:
            if len(ids) > self.max_model_len:
                raise InvalidRequest(f"input: an input has {len(ids)} tokens; the context length is "
                                     f"{self.max_model_len}")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidRequest(f"input: token id outside the vocabulary (size {self.vocab_size})")

    async def _vectors(self, req: EmbedRequest, on_cancel: Callable[[], None] | None = None) -> list[bytes]:
        """Every input's vector. Cancelled: `on_cancel()` first, then each input aborted (_one), as a generate
        request counts its cancellation before its abort (a scrape that sees the engine idle sees the count)."""
        inputs = asyncio.gather(*(self._one(ids, f"{req.request_id}-{i}-{uuid.uuid4().hex[:8]}")
                                  for i, ids in enumerate(req.inputs)))
        try:
            return await asyncio.shield(inputs)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            inputs.cancel()
            await asyncio.gather(inputs, return_exceptions=True)
            raise
        except ValueError as exc:  # vLLM's input validation
            raise InvalidRequest(str(exc)) from exc

    async def embed(self, req: EmbedRequest, ctx) -> AsyncIterator[EmbedOutput]:
        try:
            self._check(req)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise
        self.metrics.inflight.inc()
        try:
            # The caller cancelled or went away: counted, then each input aborted.
            vectors = await self._vectors(req, on_cancel=self.metrics.cancellations.inc)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise
        finally:
            self.metrics.inflight.dec()
        self.metrics.request_done("success")
        if self.on_success is not None:
            self.on_success()
        yield EmbedOutput(embeddings=vectors, prompt_tokens=sum(len(ids) for ids in req.inputs))

    async def canary(self, req: EmbedRequest) -> list[bytes]:
        """The health canary: `req` through this handler's checks and the engine, not counted as served."""
        self._check(req)
        return await self._vectors(req)

    async def _one(self, ids: list[int], engine_id: str) -> bytes:
        finished = False
        try:
            out = None
            async for out in self.engine.encode({"prompt_token_ids": ids}, PoolingParams(task="embed"), engine_id):
                pass
            finished = out is not None and out.finished
            if out is None:
                raise RequestFailed("the engine returned no embedding", code=codes.ENGINE_FAILURE)
            return out.outputs.data.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        finally:
            if not finished:  # cancelled or failed: free the engine's blocks now
                await self.engine.abort(engine_id)

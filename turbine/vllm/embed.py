"""The `embed` endpoint of a pooling vLLM worker (`--runner pooling`, e.g. `--convert embed` for
a decoder model such as SmolLM2): each input's token ids through the engine's pooler, returned
as float32 bytes. Its card lists only "embeddings"; it serves no `generate`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import torch
from vllm import PoolingParams

from turbine.protocol import errors as codes
from turbine.protocol.embed import EmbedOutput, EmbedRequest
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.worker.worker_metrics import WorkerMetrics

CANARY_TIMEOUT_S = 10.0



class EmbedHandlers:
    def __init__(self, engine, metrics: WorkerMetrics, on_success=None):
        self.engine = engine
        self.metrics = metrics
        self.on_success = on_success
        model_config = engine.vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()

    async def embed(self, req: EmbedRequest, ctx) -> AsyncIterator[EmbedOutput]:
        if not req.inputs or not all(req.inputs):
            self.metrics.error("invalid_request")
            raise InvalidRequest("input: every input must have at least one token")
        for ids in req.inputs:
            if len(ids) > self.max_model_len:
                self.metrics.error("invalid_request")
                raise InvalidRequest(f"input: an input has {len(ids)} tokens; the context length is "
                                     f"{self.max_model_len}")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                self.metrics.error("invalid_request")
                raise InvalidRequest(f"input: token id outside the vocabulary (size {self.vocab_size})")
        self.metrics.inflight.inc()
        try:
            vectors = await asyncio.gather(*(self._one(ids, f"{req.request_id}-{i}-{uuid.uuid4().hex[:8]}")
                                             for i, ids in enumerate(req.inputs)))
        except ValueError as exc:  # vLLM's input validation
            self.metrics.error("invalid_request")
            raise InvalidRequest(str(exc)) from exc
        except asyncio.CancelledError:  # the caller cancelled or went away: each input was aborted (_one)
            self.metrics.cancellations.inc()
            raise
        finally:
            self.metrics.inflight.dec()
        self.metrics.request_done("success")
        if self.on_success is not None:
            self.on_success()
        yield EmbedOutput(embeddings=vectors, prompt_tokens=sum(len(ids) for ids in req.inputs))

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


async def pooling_canary(engine) -> str | None:
    """None when the engine pooled a one-token input, else the reason it did not."""
    request_id = f"canary-{uuid.uuid4().hex[:8]}"
    try:
        async with asyncio.timeout(CANARY_TIMEOUT_S):
            async for _ in engine.encode({"prompt_token_ids": [1]}, PoolingParams(task="embed"), request_id):
                pass
    except TimeoutError:
        await engine.abort(request_id)
        return f"canary embed did not finish in {CANARY_TIMEOUT_S:.0f}s"
    except Exception as exc:
        return f"canary embed failed: {type(exc).__name__}: {exc}"
    return None

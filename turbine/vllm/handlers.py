"""Request-plane handlers of the vLLM worker: `generate` and `clear_kv_blocks`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from turbine.protocol.generate import (
    ClearKvBlocksRequest,
    GenerateOutput,
    GenerateRequest,
    StatusReply,
    TopLogprob,
    Usage,
)
from turbine.runtime.worker_metrics import WorkerMetrics

log = logging.getLogger("turbine.vllm")

# vLLM finish reasons → ours. "abort" means the request was cancelled.
_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


class InvalidRequest(ValueError):
    pass


def build_sampling_params(req: GenerateRequest, defaults: dict, max_model_len: int) -> SamplingParams:
    """Start from the model's generation_config defaults, then apply what the request set."""
    if not req.token_ids:
        raise InvalidRequest("token_ids is empty")
    if len(req.token_ids) >= max_model_len:
        raise InvalidRequest(f"prompt has {len(req.token_ids)} tokens; the context length is {max_model_len}")
    kwargs = dict(defaults)
    s = req.sampling
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(s, name)
        if value is not None:
            kwargs[name] = value
    stop = req.stop
    kwargs["max_tokens"] = stop.max_tokens if stop.max_tokens is not None else max_model_len - len(req.token_ids)
    if stop.min_tokens is not None:
        kwargs["min_tokens"] = stop.min_tokens
    if stop.stop_token_ids:
        kwargs["stop_token_ids"] = list(stop.stop_token_ids)
    kwargs["ignore_eos"] = stop.ignore_eos
    if req.output.logprobs is not None:
        kwargs["logprobs"] = req.output.logprobs
    kwargs["detokenize"] = False
    kwargs["output_kind"] = RequestOutputKind.DELTA
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(str(exc)) from exc


class Handlers:
    def __init__(self, engine, metrics: WorkerMetrics, on_cleared: Callable[[], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        # vLLM flushes its own AllBlocksCleared event only at its next step; an idle worker
        # would leave KV routers believing in the old cache, so we announce it at once.
        self.on_cleared = on_cleared
        cfg = engine.vllm_config
        self.max_model_len = cfg.model_config.max_model_len
        self.sampling_defaults = cfg.model_config.get_diff_sampling_param()

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[GenerateOutput]:
        try:
            params = build_sampling_params(req, self.sampling_defaults, self.max_model_len)
        except InvalidRequest as exc:
            self.metrics.error("invalid_request")
            yield GenerateOutput(token_ids=[], finish_reason=f"error: invalid request: {exc}")
            return
        # Unique per attempt, so a retried request id never collides inside the engine.
        engine_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        completion_tokens = [0] * params.n
        finished = False
        self.metrics.inflight.inc()
        try:
            async for out in self.engine.generate({"prompt_token_ids": req.token_ids}, params, engine_id):
                for comp in out.outputs:
                    completion_tokens[comp.index] += len(comp.token_ids)
                    chunk = GenerateOutput(token_ids=list(comp.token_ids), index=comp.index)
                    if comp.logprobs:
                        chunk.log_probs, chunk.top_logprobs = _logprobs(comp.token_ids, comp.logprobs,
                                                                        params.logprobs or 0)
                    if comp.finish_reason is not None:
                        chunk.finish_reason = _FINISH.get(comp.finish_reason, comp.finish_reason)
                        if isinstance(comp.stop_reason, int):
                            chunk.stop_reason = comp.stop_reason
                        chunk.usage = Usage(
                            prompt_tokens=len(req.token_ids),
                            completion_tokens=completion_tokens[comp.index],
                            cached_tokens=out.num_cached_tokens or 0,
                        )
                    yield chunk
                finished = out.finished
            self.metrics.request_done("success")
        except ValueError as exc:  # vLLM's input validation
            self.metrics.error("invalid_request")
            yield GenerateOutput(token_ids=[], finish_reason=f"error: invalid request: {exc}")
        finally:
            self.metrics.inflight.dec()
            if not finished:
                # Caller cancelled or went away: free the engine's KV blocks now.
                self.metrics.cancellations.inc()
                await self.engine.abort(engine_id)

    async def clear_kv_blocks(self, req: ClearKvBlocksRequest, ctx) -> AsyncIterator[StatusReply]:
        try:
            ok = await self.engine.reset_prefix_cache()
        except Exception as exc:  # report, don't crash the endpoint
            yield StatusReply(status="error", message=f"{type(exc).__name__}: {exc}")
            return
        if ok:
            if self.on_cleared is not None:
                self.on_cleared()
            yield StatusReply(status="success", message="KV cache cleared")
        else:
            yield StatusReply(status="error", message="prefix cache not reset (requests still running)")


def _logprobs(token_ids, logprobs, k: int):
    sampled, tops = [], []
    for tok, entries in zip(token_ids, logprobs):
        sampled.append(entries[tok].logprob)
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:k]
        tops.append([TopLogprob(token_id=t, logprob=lp.logprob) for t, lp in ranked])
    return sampled, tops

"""Request-plane handlers of the vLLM worker: `generate` and `clear_kv_blocks`."""

from __future__ import annotations

import asyncio
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


# What a prefill worker asks of its KV connector: keep the prompt's KV for a decode worker to pull.
_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build_sampling_params(req: GenerateRequest, defaults: dict, max_model_len: int, *,
                          role: str = "agg") -> SamplingParams:
    """Start from the model's generation_config defaults, then apply what the request set.
    A prefill worker computes the prompt and one token, and keeps the KV for a decode worker;
    a decode worker given a prefill worker's parameters pulls the KV instead of computing it."""
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
    if role == "prefill":
        if kwargs.get("n", 1) != 1:
            raise InvalidRequest("a prefill worker computes one sequence: n must be 1")
        kwargs["max_tokens"] = kwargs["min_tokens"] = 1
        kwargs["extra_args"] = {"kv_transfer_params": dict(_REMOTE_DECODE)}
    elif role == "decode" and req.kv_transfer_params is not None:
        kwargs["extra_args"] = {"kv_transfer_params": checked_kv_transfer_params(req.kv_transfer_params)}
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(str(exc)) from exc


def checked_kv_transfer_params(params: dict) -> dict:
    """The prefill worker's KV location, checked before it reaches the engine: a malformed
    one must fail this request, not the engine. Keys are the connector's; we check the types
    of those NIXL needs and allow only plain values elsewhere."""
    if params.get("do_remote_prefill") is not True:
        raise InvalidRequest("kv_transfer_params: do_remote_prefill must be true")
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params.get(key), str):
            raise InvalidRequest(f"kv_transfer_params.{key} must be a string")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise InvalidRequest("kv_transfer_params.remote_port must be a port number")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(_int_or_ints(b) for b in blocks):
        raise InvalidRequest("kv_transfer_params.remote_block_ids must be a list of block ids")
    for key, value in params.items():
        if not isinstance(key, str) or not (value is None or isinstance(value, (bool, int, float, str))
                                            or key == "remote_block_ids"):
            raise InvalidRequest(f"kv_transfer_params.{key}: unexpected value")
    return dict(params)


def _int_or_ints(value) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Handlers:
    def __init__(self, engine, metrics: WorkerMetrics, on_cleared: Callable[[], None] | None = None,
                 *, role: str = "agg", kv_transfer_timeout: float = 30.0,
                 on_success: Callable[[], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.on_success = on_success  # told of each completed request (the health checks)
        self.role = role
        self.kv_transfer_timeout = kv_transfer_timeout
        # vLLM flushes its own AllBlocksCleared event only at its next step; an idle worker
        # would leave KV routers believing in the old cache, so we announce it at once.
        self.on_cleared = on_cleared
        cfg = engine.vllm_config
        self.max_model_len = cfg.model_config.max_model_len
        self.sampling_defaults = cfg.model_config.get_diff_sampling_param()

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[GenerateOutput]:
        try:
            params = build_sampling_params(req, self.sampling_defaults, self.max_model_len, role=self.role)
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
            outputs = self.engine.generate({"prompt_token_ids": req.token_ids}, params, engine_id)
            if params.extra_args and self.role == "decode":
                outputs, engine_id = await self._pulled_or_local(req, params, outputs, engine_id)
            async for out in outputs:
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
                        if self.role == "prefill":
                            chunk.kv_transfer_params = out.kv_transfer_params
                    yield chunk
                finished = out.finished
            self.metrics.request_done("success")
            if self.on_success is not None:
                self.on_success()
        except ValueError as exc:  # vLLM's input validation
            self.metrics.error("invalid_request")
            yield GenerateOutput(token_ids=[], finish_reason=f"error: invalid request: {exc}")
        finally:
            self.metrics.inflight.dec()
            if not finished:
                # Caller cancelled or went away: free the engine's KV blocks now.
                self.metrics.cancellations.inc()
                await self.engine.abort(engine_id)

    async def _pulled_or_local(self, req: GenerateRequest, params: SamplingParams, outputs, engine_id: str):
        """Waits for the first output of a request whose KV comes from a prefill worker. If the
        KV does not arrive within --kv-transfer-timeout (prefill worker hung or gone), the
        request is aborted and computed here from scratch: slower, never stuck."""
        try:
            first = await asyncio.wait_for(anext(outputs), self.kv_transfer_timeout)
        except TimeoutError:
            log.warning("request %s: no KV from the prefill worker within %.1f s; prefilling locally",
                        req.request_id, self.kv_transfer_timeout)
            self.metrics.error("kv_transfer_timeout")
            await outputs.aclose()
            await self.engine.abort(engine_id)
            params.extra_args = None
            engine_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
            return self.engine.generate({"prompt_token_ids": req.token_ids}, params, engine_id), engine_id
        return _prepend(first, outputs), engine_id

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


async def _prepend(first, rest):
    yield first
    async for item in rest:
        yield item


def _logprobs(token_ids, logprobs, k: int):
    sampled, tops = [], []
    for tok, entries in zip(token_ids, logprobs):
        sampled.append(entries[tok].logprob)
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:k]
        tops.append([TopLogprob(token_id=t, logprob=lp.logprob) for t, lp in ranked])
    return sampled, tops

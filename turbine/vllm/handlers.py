"""Request-plane handlers of the vLLM worker: `generate` and `clear_kv_blocks`, one class per
disaggregation role (aggregated, prefill, decode), chosen once at start (HANDLERS_OF_ROLE).

Failures are typed errors (turbine.runtime.errors): a bad request raises InvalidRequest, a dead
engine ENGINE_FAILURE, an abort that the caller did not ask for CANCELLED. A stream that ends
normally ends with finish_reason "stop" or "length"."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from turbine import tracing
from turbine.protocol import errors as codes
from turbine.protocol.generate import (
    ClearKvBlocksRequest,
    GenerateOutput,
    GenerateRequest,
    StatusReply,
    TopLogprob,
    Usage,
)
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.vllm.compat import CLIENT_ERRORS
from turbine.vllm.ec_connector import ec_transfer_params
from turbine.vllm.embedding_store import EmbeddingUnavailable, check_location
from turbine.vllm.images import multimodal_prompt
from turbine.vllm.lora import NO_LORA, VllmLora
from turbine.vllm.text_mode import prompt_token_ids, text_request, text_sampling_kwargs
from turbine.vllm.prompt_embeds import load_prompt_embeds
from turbine.worker.admission import Admission
from turbine.worker.worker_metrics import WorkerMetrics

log = logging.getLogger("turbine.vllm")

STRUCTURED = "structured_outputs"  # the GenerateRequest field named in its errors

# What a prefill worker asks of its KV connector: keep the prompt's KV for a decode worker to pull.
_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def sampling_kwargs(req: GenerateRequest, defaults: dict, max_model_len: int, prompt_len: int | None = None) -> dict:
    """SamplingParams' arguments: the model's generation_config defaults, then what the request set.
    `prompt_len`: the prompt's length when it is not `req.token_ids` (prompt embeddings)."""
    if prompt_len is None:
        if not req.token_ids:
            raise InvalidRequest("token_ids is empty")
        prompt_len = len(req.token_ids)
    if prompt_len >= max_model_len:
        raise InvalidRequest(f"prompt has {prompt_len} tokens; the context length is {max_model_len}")
    kwargs = dict(defaults)
    s = req.sampling
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
        value = getattr(s, name)
        if value is not None:
            kwargs[name] = value
    stop = req.stop
    if stop.max_tokens is not None and prompt_len + stop.max_tokens > max_model_len:
        raise InvalidRequest(f"max_tokens: the prompt has {prompt_len} tokens and max_tokens is {stop.max_tokens}, "
                             f"over the context length of {max_model_len}")
    kwargs["max_tokens"] = stop.max_tokens if stop.max_tokens is not None else max_model_len - prompt_len
    if stop.min_tokens is not None:
        kwargs["min_tokens"] = stop.min_tokens
    if stop.stop_token_ids:
        kwargs["stop_token_ids"] = list(stop.stop_token_ids)
    kwargs["ignore_eos"] = stop.ignore_eos
    if req.output.logprobs is not None:
        kwargs["logprobs"] = req.output.logprobs
    if req.output.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = req.output.prompt_logprobs
    if req.structured_outputs is not None:
        if req.structured_outputs.disable_any_whitespace:
            # vLLM's backends read it from the engine's config only: per request it would be ignored.
            raise InvalidRequest("structured_outputs.disable_any_whitespace is not supported per request",
                                 param=STRUCTURED)
        fields = {k: v for k, v in msgspec.structs.asdict(req.structured_outputs).items() if v is not None}
        try:
            kwargs["structured_outputs"] = StructuredOutputsParams(**fields)
        except (ValueError, *CLIENT_ERRORS) as exc:  # pydantic's and vLLM's own validation errors
            raise InvalidRequest(f"structured outputs: {exc}", param=STRUCTURED) from None
    kwargs["detokenize"] = False
    kwargs["output_kind"] = RequestOutputKind.DELTA
    return kwargs


def sampling_params(kwargs: dict) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError, *CLIENT_ERRORS) as exc:
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
    """What every role shares; the role classes below add their part."""

    def __init__(self, engine, metrics: WorkerMetrics, on_cleared: Callable[[], None] | None = None,
                 *, kv_transfer_timeout: float = 30.0, on_success: Callable[[], None] | None = None,
                 data_parallel_size: int = 1, text_mode: bool = False, chat_template: str | None = None,
                 admission: Admission | None = None, loras: VllmLora | None = None, multimodal: bool = False,
                 take_image_embeddings: bool = False):
        self.engine = engine
        self.multimodal = multimodal  # --enable-multimodal: requests may carry images
        # --take-image-embeddings: the engine's EC connector loads encode workers' embeddings (ec_connector.py)
        self.take_image_embeddings = take_image_embeddings
        self.loras = loras  # the LoRA adapters loaded (None: the worker takes none)
        self.admission = admission or Admission(None, None)  # overload control (no bounds by default)
        self.text_mode = text_mode  # --use-vllm-tokenizer: requests carry text (GenerateRequest.text)
        self.chat_template = chat_template  # text mode: --custom-jinja-template's text (None: the model's)
        self.metrics = metrics
        self.on_success = on_success  # told of each completed request (the health checks)
        self.kv_transfer_timeout = kv_transfer_timeout
        self.data_parallel_size = data_parallel_size
        # vLLM flushes its own AllBlocksCleared event only at its next step; an idle worker
        # would leave KV routers believing in the old cache, so we announce it at once.
        self.on_cleared = on_cleared
        cfg = engine.vllm_config
        self.max_model_len = cfg.model_config.max_model_len
        self.sampling_defaults = cfg.model_config.get_diff_sampling_param()
        self.model_config = cfg.model_config
        # What the engine widens an image token to, and its range (the worker measures it at start; None: it
        # depends on the picture): max_tokens is checked against the widened prompt.
        self.image_placeholder: tuple[list[int], tuple[int, int]] | None = None

    def sampling_params(self, req: GenerateRequest, prompt_len: int | None = None) -> SamplingParams:
        """The request checked and turned into the engine's SamplingParams (InvalidRequest if bad)."""
        self.lora_request(req)  # an adapter that is not loaded here: refused before any work
        if req.dp_rank is not None and not 0 <= req.dp_rank < self.data_parallel_size:
            raise InvalidRequest(f"dp_rank {req.dp_rank} out of range: this worker has data-parallel ranks "
                                 f"0..{self.data_parallel_size - 1}")
        if (req.text is not None) != self.text_mode:
            raise InvalidRequest("this worker serves text mode (--use-vllm-tokenizer): send text, not token_ids"
                                 if self.text_mode else "text: this worker takes token ids (no --use-vllm-tokenizer)")
        kwargs = sampling_kwargs(req, self.sampling_defaults, self.max_model_len, prompt_len)
        if req.text is not None:
            kwargs = text_sampling_kwargs(req.text, kwargs)
        kwargs = self._role_kwargs(req, kwargs)
        if req.image_embeddings is not None:
            self._check_image_embeddings(req)
            kwargs["extra_args"] = {**(kwargs.get("extra_args") or {}),
                                    "ec_transfer_params": ec_transfer_params(req.image_embeddings)}
        return sampling_params(kwargs)

    def _check_image_embeddings(self, req: GenerateRequest) -> None:
        if not self.take_image_embeddings:
            raise InvalidRequest("image_embeddings: this worker does not take image embeddings (start it with "
                                 "--take-image-embeddings)")
        if [e.hash for e in req.image_embeddings] != [i.hash for i in req.images or ()]:
            raise InvalidRequest("image_embeddings: one per image, in the images' order, with their hashes")
        hidden = self.model_config.get_hidden_size()
        for e in req.image_embeddings:
            try:
                check_location(e)
            except EmbeddingUnavailable as exc:
                raise InvalidRequest(f"image_embeddings: {exc}") from None
            if e.shape[1] != hidden:
                raise InvalidRequest(f"image_embeddings: image {e.hash[:16]} has embeddings {e.shape[1]} wide; "
                                     f"this model's are {hidden}")

    async def _prepared(self, req: GenerateRequest) -> tuple[GenerateRequest, dict, SamplingParams]:
        """The request, the engine's prompt and its sampling parameters. Text mode: the prompt is
        rendered and tokenized here first; prompt embeddings: loaded and checked."""
        if req.text is not None and self.text_mode:
            ids = await prompt_token_ids(self.engine, req, self.chat_template)
            req = text_request(req, ids, self.max_model_len)
        prompt = await self.engine_prompt(req)
        embeds = prompt.get("prompt_embeds")
        prompt_len = None if embeds is None else len(embeds)
        if req.images and self.image_placeholder is not None:  # the prompt as the engine will hold it
            prompt_len = len(req.token_ids) + len(req.images) * (len(self.image_placeholder[0]) - 1)
        return req, prompt, self.sampling_params(req, prompt_len)

    async def engine_prompt(self, req: GenerateRequest) -> dict:
        """The engine's prompt: the token ids, or the prompt embeddings loaded and checked."""
        if req.images:
            if not self.multimodal:
                raise InvalidRequest("images: this worker takes no images (start it with --enable-multimodal)")
            if req.prompt_embeds is not None:
                raise InvalidRequest("images: a prompt given as embeddings takes no images")
            # Pillow decodes off the event loop, which serves every other request.
            prompt = await asyncio.to_thread(multimodal_prompt, req.token_ids, req.images)
            pixels = sum(item.pixels is not None for item in req.images)
            for form, count in (("pixels", pixels), ("file", len(req.images) - pixels)):
                if count:
                    self.metrics.images(form, count)
            return prompt
        if req.prompt_embeds is None:
            return {"prompt_token_ids": req.token_ids}
        if not self.model_config.enable_prompt_embeds:
            raise InvalidRequest("prompt_embeds: this worker does not take prompt embeddings "
                                 "(start it with --enable-prompt-embeds)")
        if req.token_ids:
            raise InvalidRequest("prompt_embeds: give either token_ids or prompt_embeds, not both")
        # torch.load of megabytes: off the event loop, which serves every other request.
        embeds = await asyncio.to_thread(
            load_prompt_embeds, req.prompt_embeds, hidden_size=self.model_config.get_hidden_size(),
            dtype=self.model_config.dtype, max_model_len=self.max_model_len)
        return {"prompt_embeds": embeds}

    def lora_request(self, req: GenerateRequest):
        """The engine's LoRARequest for the request's adapter (None: the base model)."""
        if req.lora_name is None:
            return None
        if self.loras is None:
            raise InvalidRequest(f"lora_name {req.lora_name!r}: {NO_LORA}", param="lora_name")
        return self.loras.request(req.lora_name)

    def _role_kwargs(self, req: GenerateRequest, kwargs: dict) -> dict:
        return kwargs

    def _engine_generate(self, req: GenerateRequest, prompt: dict, params: SamplingParams, engine_id: str,
                         lora=None):
        # Tracing: the engine's spans join the request's trace (the worker's span is current here).
        trace = tracing.current_carrier()
        if trace is None:
            return self.engine.generate(prompt, params, engine_id, lora_request=lora, data_parallel_rank=req.dp_rank)
        headers = {"traceparent": trace[0], "tracestate": trace[1]} if trace[1] else {"traceparent": trace[0]}
        return self.engine.generate(prompt, params, engine_id, lora_request=lora, data_parallel_rank=req.dp_rank,
                                    trace_headers=headers)

    async def _outputs(self, req: GenerateRequest, prompt: dict, params: SamplingParams, engine_id: str, lora=None):
        """The engine's outputs for the request, and the engine-side id they run under."""
        return self._engine_generate(req, prompt, params, engine_id, lora), engine_id

    def _finished(self, chunk: GenerateOutput, out) -> None:
        """The role's additions to a choice's last chunk."""

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[GenerateOutput]:
        try:
            req, prompt, params = await self._prepared(req)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise  # the caller gets it as a typed error (HTTP 400 at the frontend)
        # Unique per attempt, so a retried request id never collides inside the engine.
        engine_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        completion_tokens = [0] * params.n
        prompt_len = len(prompt["prompt_embeds"]) if "prompt_embeds" in prompt else len(req.token_ids)
        # Refused (OVERLOADED) here, before the engine sees it: nothing to abort or free.
        lora = self.lora_request(req)  # checked in _prepared, with no await since
        ticket = self.admission.admit(0 if req.kv_transfer_params is not None else prompt_len)
        # The adapter is held until the request ends: an unload waits for it (VllmLora.remove).
        held = self.loras.hold(req.lora_name) if lora is not None else None
        finished = False
        self.metrics.inflight.inc()
        try:
            outputs, engine_id = await self._outputs(req, prompt, params, engine_id, lora)
            prompt_sent = False
            async for out in outputs:
                ticket.started()
                for comp in out.outputs:
                    completion_tokens[comp.index] += len(comp.token_ids)
                    chunk = GenerateOutput(token_ids=list(comp.token_ids), index=comp.index)
                    if req.text is not None:
                        chunk.text = comp.text
                    if comp.logprobs:
                        chunk.log_probs, chunk.top_logprobs = _logprobs(comp.token_ids, comp.logprobs,
                                                                        params.logprobs or 0)
                    if params.prompt_logprobs is not None and not prompt_sent and out.prompt_logprobs:
                        # once, on the request's first chunk
                        prompt_sent = True
                        chunk.prompt_log_probs, chunk.prompt_top_logprobs = _prompt_logprobs(
                            req.token_ids, out.prompt_logprobs, params.prompt_logprobs or 0)
                    if comp.finish_reason is not None:
                        if comp.finish_reason == "abort":  # not ours: we abort only in `finally` below
                            self.metrics.error("aborted")
                            raise RequestFailed("the engine aborted the request", code=codes.CANCELLED)
                        if comp.finish_reason == "error":  # vLLM's request-level failure (e.g. a grammar
                            self.metrics.error("engine_failure")  # that failed to compile): not an answer
                            raise RequestFailed("the engine failed the request", code=codes.ENGINE_FAILURE)
                        chunk.finish_reason = comp.finish_reason
                        if isinstance(comp.stop_reason, int):
                            chunk.stop_reason = comp.stop_reason
                        chunk.usage = Usage(
                            # with images, the engine's prompt (each image token widened to the image's tokens)
                            prompt_tokens=len(out.prompt_token_ids) if req.images and out.prompt_token_ids
                            else prompt_len,
                            completion_tokens=completion_tokens[comp.index],
                            cached_tokens=out.num_cached_tokens or 0,
                        )
                        self._finished(chunk, out)
                    yield chunk
                finished = out.finished
            self.metrics.request_done("success")
            if self.on_success is not None:
                self.on_success()
        except (EngineDeadError, EngineGenerateError) as exc:
            self.metrics.error("engine_failure")
            raise RequestFailed(f"the engine failed: {type(exc).__name__}: {exc}",
                                code=codes.ENGINE_FAILURE) from exc
        except RequestFailed:
            raise
        except CLIENT_ERRORS as exc:
            # vLLM checks the request when adding it, before its engine core sees it; the checks
            # other than the constraint's we made above, so an error without a parameter is the
            # constraint's (a schema or grammar the backend cannot compile).
            self.metrics.error("invalid_request")
            about_constraint = getattr(exc, "parameter", None) is None and req.structured_outputs is not None
            raise InvalidRequest(str(exc), param=STRUCTURED if about_constraint else None) from exc
        except ValueError as exc:  # vLLM's input validation (e.g. a token id out of vocabulary)
            self.metrics.error("invalid_request")
            raise InvalidRequest(str(exc)) from exc
        finally:
            ticket.release()
            if held is not None:
                held()
            self.metrics.inflight.dec()
            if not finished:
                # Caller cancelled or went away: free the engine's KV blocks now.
                self.metrics.cancellations.inc()
                await self.engine.abort(engine_id)

    async def canary(self, req: GenerateRequest):
        """Run `req` as this role runs a request (its checks and its role's sampling) without counting it as
        served or admitting it; returns the engine's last output. InvalidRequest (or vLLM's own error) if
        refused."""
        req, prompt, params = await self._prepared(req)
        self._canary_params(params)
        engine_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        outputs, engine_id = await self._outputs(req, prompt, params, engine_id)
        last, finished = None, False
        try:
            async for out in outputs:
                last, finished = out, out.finished
        finally:
            if not finished:
                await self.engine.abort(engine_id)
        return last

    def _canary_params(self, params: SamplingParams) -> None:
        """What the role changes in its canary's sampling."""

    async def clear_kv_blocks(self, req: ClearKvBlocksRequest, ctx) -> AsyncIterator[StatusReply]:
        try:
            if self.multimodal:  # the images' encoder outputs are cached state too
                await self.engine.reset_encoder_cache()
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


class AggregatedHandlers(Handlers):
    """Whole requests: prompt and answer."""


class PrefillHandlers(Handlers):
    """Computes the prompt and one token, and keeps the KV for a decode worker to pull (its
    location goes out on the last chunk)."""

    def _role_kwargs(self, req: GenerateRequest, kwargs: dict) -> dict:
        if req.prompt_embeds is not None:  # the frontend prefills those where they are decoded
            raise InvalidRequest("prompt_embeds: a prefill worker does not take prompt embeddings")
        if kwargs.get("n", 1) != 1:
            raise InvalidRequest("a prefill worker computes one sequence: n must be 1")
        kwargs["max_tokens"] = kwargs["min_tokens"] = 1
        kwargs["extra_args"] = {"kv_transfer_params": dict(_REMOTE_DECODE)}
        return kwargs

    def _finished(self, chunk: GenerateOutput, out) -> None:
        chunk.kv_transfer_params = out.kv_transfer_params

    def _canary_params(self, params: SamplingParams) -> None:
        """The canary is a prefill (this role's checks, one token) whose KV is not kept for a decode worker:
        none would pull it, and vLLM cannot release such blocks itself (its NIXL connector refuses to hand
        them to its own engine), so they would stay pinned until the connector's lease ran out (30 s in
        0.32, VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, in older releases): freed when the prefill ends."""
        extra = {k: v for k, v in (params.extra_args or {}).items() if k != "kv_transfer_params"}
        params.extra_args = extra or None


class DecodeHandlers(Handlers):
    """Given a prefill worker's kv_transfer_params, pulls the prompt's KV instead of computing it."""

    def _role_kwargs(self, req: GenerateRequest, kwargs: dict) -> dict:
        if req.kv_transfer_params is not None:
            if req.output.prompt_logprobs is not None:
                raise InvalidRequest("prompt_logprobs (echo with logprobs) cannot be computed for a prompt "
                                     "prefilled on another worker")
            kwargs["extra_args"] = {"kv_transfer_params": checked_kv_transfer_params(req.kv_transfer_params)}
        return kwargs

    async def _outputs(self, req: GenerateRequest, prompt: dict, params: SamplingParams, engine_id: str, lora=None):
        """Waits for the first output of a request whose KV comes from a prefill worker. If the
        KV does not arrive within --kv-transfer-timeout (prefill worker hung or gone), the
        request is aborted and computed here from scratch: slower, never stuck."""
        outputs = self._engine_generate(req, prompt, params, engine_id, lora)
        if not (params.extra_args or {}).get("kv_transfer_params"):
            return outputs, engine_id
        try:
            first = await asyncio.wait_for(anext(outputs), self.kv_transfer_timeout)
        except TimeoutError:
            log.warning("request %s: no KV from the prefill worker within %.1f s; prefilling locally",
                        req.request_id, self.kv_transfer_timeout)
            self.metrics.error("kv_transfer_timeout")
            await outputs.aclose()
            await self.engine.abort(engine_id)
            params.extra_args = {k: v for k, v in params.extra_args.items() if k != "kv_transfer_params"} or None
            engine_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
            return self._engine_generate(req, prompt, params, engine_id, lora), engine_id
        return _prepend(first, outputs), engine_id


HANDLERS_OF_ROLE: dict[str, type[Handlers]] = {
    "agg": AggregatedHandlers, "prefill": PrefillHandlers, "decode": DecodeHandlers}


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


def _prompt_logprobs(token_ids, prompt_logprobs, k: int):
    """vLLM's per-prompt-token dicts (None for the first token) -> logprobs and top k."""
    sampled, tops = [], []
    for tok, entries in zip(token_ids, prompt_logprobs):
        if entries is None:
            sampled.append(None)
            tops.append([])
            continue
        sampled.append(entries[tok].logprob)
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:k]
        tops.append([TopLogprob(token_id=t, logprob=lp.logprob) for t, lp in ranked])
    return sampled, tops

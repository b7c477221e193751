"""The OpenAI-compatible HTTP app: /v1/models, /v1/chat/completions, /v1/completions,
plus /health, /live and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbine.config import DiscoveryConfig, make_registry
from turbine.frontend.disagg import DisaggConfig
from turbine.frontend.generation import ChoiceDelta, Generation, WorkerFailed
from turbine.frontend.event_stream import EventStreamResponse
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models import ModelTable, ServedModel
from turbine.frontend.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_request,
    prompt_of,
    stop_list,
    validate_chat,
    validate_completion,
)
from turbine.router.policy import RouterConfig, make_router
from turbine.protocol.generate import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from turbine.runtime.request_plane import RequestPlaneClient

log = logging.getLogger("turbine.frontend")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    router: RouterConfig = RouterConfig()
    namespace: str | None = None  # serve models of this namespace only; None = all
    api_key: str | None = None
    max_request_bytes: int = 8 << 20
    discovery: DiscoveryConfig = DiscoveryConfig()
    disagg: DisaggConfig = DisaggConfig()


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}},
                        status_code=status)


class Frontend:
    def __init__(self, cfg: FrontendConfig):
        self.cfg = cfg
        self.metrics = FrontendMetrics()
        self.registry = make_registry(cfg.discovery)
        self.models = ModelTable(self.registry, lambda card: make_router(cfg.router, card, self.metrics.router), cfg.namespace)
        self.client = RequestPlaneClient()
        self._watch_task = None

    # -- lifecycle ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await self.registry.backend.start()
        self._watch_task = asyncio.create_task(self.models.run())
        try:
            yield
        finally:
            self._watch_task.cancel()
            await self.client.close()
            await self.registry.backend.close()

    def app(self):
        """The ASGI app. The two generation routes are served here directly; the rest (and
        the lifespan) by Starlette. Generation responses carry one write per token or so,
        and Starlette's middleware would wrap every one of those writes twice."""
        routes = [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/live", self.live, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        others = Starlette(routes=routes, lifespan=self.lifespan,
                           exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})
        generation_routes = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

        async def app(scope, receive, send):
            kind = generation_routes.get(scope["path"]) if scope["type"] == "http" else None
            if kind is None:
                return await others(scope, receive, send)
            request = Request(scope, receive)
            if scope["method"] != "POST":
                response = _error(405, f"{scope['path']} takes POST", "invalid_request_error")
                response.headers["allow"] = "POST"
            else:
                try:
                    response = await self._serve(request, kind)
                except Exception as exc:
                    response = await self._internal_error(request, exc)
            await response(scope, receive, send)

        return app

    async def _http_error(self, request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def _internal_error(self, request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}", "internal_server_error")

    # -- plain endpoints ---------------------------------------------------------------
    async def live(self, request: Request):
        return JSONResponse({"status": "live"})

    async def health(self, request: Request):
        models = {name: len(m.instances) for name, m in self.models.models.items()}
        if not models:
            return JSONResponse({"status": "unhealthy", "reason": "no live workers", "models": {}},
                                status_code=503)
        body = {"status": "healthy", "models": models}
        prefill = {name: len(m.prefill_instances) for name, m in self.models.models.items() if m.prefill_instances}
        if prefill:
            body["prefill_workers"] = prefill  # models served disaggregated
        return JSONResponse(body)

    async def prometheus(self, request: Request):
        for model in self.models.models.values():
            model.router.export_metrics()
            if model.prefill_router is not None:
                model.prefill_router.export_metrics()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def list_models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "turbine"}
                for name in sorted(self.models.models)]
        return JSONResponse({"object": "list", "data": data})

    # -- generation endpoints ----------------------------------------------------------
    async def _serve(self, request: Request, kind: str):
        model_name = "-"
        try:
            if (denied := self._auth(request)) is not None:
                return denied
            body = await self._read_body(request)
            if kind == "chat":
                req = decode_request(body, ChatCompletionRequest)
                validate_chat(req)
            else:
                req = decode_request(body, CompletionRequest)
                validate_completion(req)
            model = self._model(req.model, kind)
            model_name = model.name
            gen = await self._generation(model, req, kind)
            gen.metrics.input_tokens.inc(len(gen.request.token_ids))
            if req.stream:
                response = await self._stream(gen, req, kind)
            else:
                response = await self._complete(gen, req, kind)
            self.metrics.requests.labels(model_name, kind, str(response.status_code)).inc()
            return response
        except RequestError as exc:
            self.metrics.requests.labels(model_name, kind, str(exc.status)).inc()
            return JSONResponse(exc.body(), status_code=exc.status)
        except WorkerFailed as exc:
            log.warning("request failed on its worker: %s", exc)
            self.metrics.requests.labels(model_name, kind, "502").inc()
            return _error(502, str(exc), "worker_error")

    def _auth(self, request: Request) -> JSONResponse | None:
        key = self.cfg.api_key
        if key is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        return _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                      "authentication_error")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    def _model(self, name: str, kind: str) -> ServedModel:
        model = self.models.models.get(name)
        if model is None or not model.instances:
            raise RequestError(f"the model {name!r} does not exist or has no live worker", param="model",
                               status=404, code="model_not_found")
        if kind not in model.card.endpoint_types:
            raise RequestError(f"the model {name!r} does not serve {kind} requests", param="model")
        return model

    async def _generation(self, model: ServedModel, req, kind: str) -> Generation:
        tok = model.tokenizer
        if kind == "chat":
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                               tools=req.tools, **(req.chat_template_kwargs or {}))
            except ValueError as exc:
                raise RequestError(f"cannot apply the chat template: {exc}", param="messages") from None
            # The template writes BOS and friends itself: no post-processor on top.
            token_ids = await tok.encode_off_loop(text, add_special_tokens=False)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            prompt = prompt_of(req)
            token_ids = await tok.encode_off_loop(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            max_tokens = req.max_tokens
            logprobs = req.logprobs
            vocab = tok.vocab_size
            if isinstance(prompt, list) and max(prompt) >= vocab:
                raise RequestError(f"prompt: token id {max(prompt)} is outside the vocabulary (size {vocab})",
                                   param="prompt")
        context = model.card.context_length
        if len(token_ids) >= context:
            raise RequestError(f"the prompt has {len(token_ids)} tokens but the model's context length is "
                               f"{context}", param="messages" if kind == "chat" else "prompt")
        if max_tokens is None:
            max_tokens = context - len(token_ids)
        elif len(token_ids) + max_tokens > context:
            raise RequestError(f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}, "
                               f"{len(token_ids) + max_tokens} in all, over the model's context length of "
                               f"{context}", param="max_tokens")
        if req.min_tokens is not None and req.min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})",
                               param="min_tokens")
        if req.stop_token_ids and max(req.stop_token_ids) >= tok.vocab_size:
            raise RequestError("stop_token_ids: token id outside the vocabulary", param="stop_token_ids")
        gen_req = GenerateRequest(
            request_id=uuid.uuid4().hex,
            model=model.name,
            token_ids=token_ids,
            sampling=SamplingOptions(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty),
            stop=StopConditions(max_tokens=max_tokens, min_tokens=req.min_tokens,
                                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos),
            output=OutputOptions(logprobs=logprobs),
        )
        return Generation(model, self.client, gen_req, stop=stop_list(req.stop),
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, metrics=self.metrics.of(model.name),
                          disagg=self.cfg.disagg)

    async def _complete(self, gen: Generation, req, kind: str) -> JSONResponse:
        n = gen.request.sampling.n
        texts = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)]
        finish = [None] * n
        started = time.monotonic()
        gen.metrics.inflight.inc()
        try:
            async for delta in gen.events():
                texts[delta.index].append(delta.text)
                logprobs[delta.index].extend(delta.logprobs)
                if delta.finish_reason:
                    finish[delta.index] = delta.finish_reason
        finally:
            gen.metrics.inflight.dec()
            gen.metrics.duration.observe(time.monotonic() - started)
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            lp = self._format_logprobs(gen, logprobs[i], kind) if gen.request.output.logprobs is not None else None
            if kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        body = {
            "id": self._response_id(gen, kind), "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": gen.model.name, "choices": choices,
            "usage": self._usage(gen),
        }
        return Response(_json.encode(body), media_type="application/json")

    async def _stream(self, gen: Generation, req, kind: str) -> Response:
        events = gen.events()
        # Wait for the first output before answering, so that errors found by the worker
        # (or no reachable worker) still become a proper HTTP status.
        first = await anext(events, None)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        with_logprobs = gen.request.output.logprobs is not None
        metrics = gen.metrics
        # Every chunk shares its head and tail: encode them once.
        head = _json.encode({"id": self._response_id(gen, kind), "object": obj, "created": int(time.time()),
                             "model": gen.model.name})
        prefix = b"data: " + head[:-1] + b',"choices":'
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

        def chunk(choices, usage=None) -> bytes:
            if usage is not None:
                return prefix + _json.encode(choices) + b',"usage":' + _json.encode(usage) + b"}\n\n"
            return prefix + _json.encode(choices) + tail

        def choice(delta: ChoiceDelta) -> dict:
            lp = self._format_logprobs(gen, delta.logprobs, kind) if with_logprobs else None
            if kind == "chat":
                return {"index": delta.index, "delta": {"content": delta.text}, "logprobs": lp,
                        "finish_reason": delta.finish_reason}
            return {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason}

        async def body():
            started = time.monotonic()
            metrics.inflight.inc()
            completed = False
            try:
                if kind == "chat":
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(gen.request.sampling.n)])
                delta = first
                while delta is not None:
                    if delta.text or delta.finish_reason or delta.logprobs:
                        yield chunk([choice(delta)])
                    delta = await anext(events, None)
                if include_usage:
                    yield chunk([], self._usage(gen))
                completed = True
            except (WorkerFailed, RequestError) as exc:
                log.warning("stream failed: %s", exc)
                err = {"error": {"message": str(exc), "type": "worker_error", "param": None, "code": None}}
                yield b"data: " + _json.encode(err) + b"\n\n"
                completed = True
            finally:
                metrics.inflight.dec()
                metrics.duration.observe(time.monotonic() - started)
                if not completed:
                    metrics.disconnects.inc()
                await events.aclose()
            yield b"data: [DONE]\n\n"

        return EventStreamResponse(body(), more_ready=lambda: gen.output_ready() or all(gen.finished))

    @staticmethod
    def _response_id(gen: Generation, kind: str) -> str:
        return ("chatcmpl-" if kind == "chat" else "cmpl-") + gen.request.request_id

    def _usage(self, gen: Generation) -> dict:
        u = gen.usage
        gen.metrics.cached_tokens.inc(u.cached_tokens)
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    @staticmethod
    def _format_logprobs(gen: Generation, entries, kind: str):
        tok = gen.model.tokenizer
        piece = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
        if kind == "chat":
            content = []
            for e in entries:
                s = piece(e.token_id)
                tops = [(piece(t), lp) for t, lp in e.top]
                content.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": ts, "logprob": lp, "bytes": list(ts.encode())}
                                                 for ts, lp in tops]})
            return {"content": content}
        tokens = [piece(e.token_id) for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries],
                "text_offset": []}

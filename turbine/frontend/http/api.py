"""The http stage: routes, authentication, body limits, and the mapping of every failure to
an OpenAI-style error (HTTP status + body, or an SSE error event once a stream has started).
A generation request runs the stages in order:

    preprocess (body -> Prepared) -> dispatch (workers' outputs) -> postprocess (Deltas)
    -> format (chat or completions, JSON or SSE)

Every request that makes a worker work (generation and embeddings) runs under a ClientWatch
(disconnect.py): a client that leaves before its answer is complete cancels it, which aborts its
engine requests, streamed or not.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Literal

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbine import tracing
from turbine.frontend import request_id
from turbine.frontend.apis import anthropic
from turbine.frontend.apis.batch import BatchRun
from turbine.frontend.apis.embeddings import embeddings
from turbine.frontend.apis.images import answers_images_only, image_chat, images_generations
from turbine.frontend.apis.response_routes import ResponseRoutes
from turbine.frontend.apis.responses import ResponsesRun
from turbine.frontend.apis.responses import prepare as prepare_response
from turbine.frontend.apis.stored_responses import owner_of
from turbine.frontend.deltas import Delta
from turbine.frontend.errors import RETRY_LATER, ModelAsleep, Overloaded, RequestError, WorkerFailed
from turbine.frontend.event_stream import EventStreamResponse
from turbine.frontend.http.disconnect import ClientWatch
from turbine.frontend.http.openapi import OPENAPI_PATH, openapi_json
from turbine.frontend.http.overload import InflightLimit
from turbine.frontend.http.utility_routes import UtilityRoutes
from turbine.frontend.pipeline import Pipeline, Writing
from turbine.frontend.postprocess.format import SseChunks
from turbine.frontend.preprocess.stage import Kind, preprocess_all
from turbine.frontend.preprocess.structured import WORKER_PARAM
from turbine.logging_setup import request_id_var
from turbine.runtime.errors import FrameTooLarge

if TYPE_CHECKING:
    from turbine.frontend.app import Frontend

log = logging.getLogger("turbine.frontend")
access_log = logging.getLogger("turbine.access")
# Probes log their access lines at DEBUG: `turbine serve` asks /health twice a second while its engine starts,
# and an orchestrator asks every few seconds for as long as the frontend runs.
PROBE_PATHS = frozenset({"/health", "/live"})

# The Responses API (turbine/frontend/apis/responses.py) and Anthropic's Messages API
# (turbine/frontend/apis/anthropic.py) run on the chat path.
GENERATION_ROUTES: dict[str, Kind | Literal["responses", "messages"]] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
    "/v1/messages": "messages"}
EMBEDDINGS_ROUTE = "/v1/embeddings"
IMAGES_ROUTE = "/v1/images/generations"
# The routes that make a worker work outside the chat/completions stages.
OTHER_WORK_ROUTES = {EMBEDDINGS_ROUTE: "embeddings", IMAGES_ROUTE: "images"}
# The status written in the access log and counted in turbine_frontend_requests for a request whose
# client left before its answer was complete (nginx's "client closed request").
CLIENT_LEFT = 499


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def asgi_app(frontend: Frontend):
    """The frontend's OpenAI-compatible ASGI app (its lifespan is the frontend's)."""
    return HttpApi(frontend).app()


class HttpApi:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.cfg = frontend.cfg
        self.metrics = frontend.metrics
        self.inflight = InflightLimit(self.cfg.max_inflight_requests)

    def app(self):
        """The ASGI app. The two generation routes are served here directly; the rest (and
        the lifespan) by Starlette. Generation responses carry one write per token or so,
        and Starlette's middleware would wrap every one of those writes twice."""
        routes = [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/live", self.live, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route(OPENAPI_PATH, self.openapi, methods=["GET"]),
            *UtilityRoutes(self.frontend, self._auth).routes(),
            *ResponseRoutes(self.frontend.records, self.frontend.background, self._auth, self._owner).routes(),
        ]
        others = Starlette(routes=routes, lifespan=self.frontend.lifespan,
                           exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return await others(scope, receive, send)
            obs = _Observed(scope, self.cfg.access_log)
            try:
                kind = OTHER_WORK_ROUTES.get(scope["path"]) or GENERATION_ROUTES.get(scope["path"])
                if obs.refusal is not None:
                    response = obs.refusal
                elif kind is None:  # Starlette's routes: one or two writes, seen through a wrapper
                    return await others(scope, receive, obs.wrap(send))
                elif scope["method"] != "POST":
                    response = error_response(405, f"{scope['path']} takes POST", "invalid_request_error")
                    response.headers["allow"] = "POST"
                elif not self.inflight.try_enter():
                    self.metrics.inflight_limit.inc()
                    response = self._error(Overloaded(f"the server holds {self.inflight.limit} requests already "
                                                      f"(--max-inflight-requests); retry later"))
                else:
                    watch = ClientWatch(receive)
                    request = Request(scope, watch.receive)
                    try:  # held until the answer's last byte is sent
                        work = self.json_work(request, embeddings) if kind == "embeddings" \
                            else self.json_work(request, images_generations) if kind == "images" \
                            else self.generate(request, kind)
                        try:
                            response = await watch.run(work)
                        except Exception as exc:
                            response = await self._internal_error(request, exc)
                        if response is None:  # the client left first: its work was cancelled
                            obs.status = CLIENT_LEFT
                            return
                        if kind == "messages" and response.status_code >= 400:
                            response = anthropic.anthropic_error(response)
                        obs.respond(response)  # a generation answer's writes go straight to the server
                        await response(scope, watch.receive, send)
                    finally:
                        watch.close()
                        self.inflight.leave()
                    return
                if kind == "messages":
                    response = anthropic.anthropic_error(response)
                obs.respond(response)
                await response(scope, receive, send)
            finally:
                obs.done()

        return app

    async def _http_error(self, request: Request, exc: HTTPException):
        response = error_response(exc.status_code, str(exc.detail), "invalid_request_error")
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow (RFC 9110 requires it)
        return response

    async def _internal_error(self, request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_server_error")

    # -- plain endpoints ---------------------------------------------------------------
    async def live(self, request: Request):
        return JSONResponse({"status": "live"})

    async def health(self, request: Request):
        served = self.frontend.models.models
        models = {name: len(m.instances) for name, m in served.items()}
        if not models:
            return JSONResponse({"status": "unhealthy", "reason": "no live workers", "models": {}},
                                status_code=503)
        body = {"status": "healthy", "models": models}
        prefill = {name: len(m.prefill_instances) for name, m in served.items() if m.prefill_instances}
        if prefill:
            body["prefill_workers"] = prefill  # models served disaggregated
        encode = {name: len(m.encode_instances) for name, m in served.items() if m.encode_instances}
        if encode:
            body["encode_workers"] = encode  # models whose images are encoded apart (encode.py)
        pools = {name: m.router.workers_per_pool() for name, m in served.items()
                 if hasattr(m.router, "workers_per_pool") and m.lora_name is None}
        if pools:
            body["pools"] = pools  # the global router (--pool): each pool's live workers per model
        return JSONResponse(body)

    async def prometheus(self, request: Request):
        self.frontend.export_router_metrics()
        return Response(self.metrics.exposition.text(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request):
        """The OpenAPI document (turbine/frontend/http/openapi.py); no API key: it is the same everywhere."""
        return Response(openapi_json(), media_type="application/json")

    async def list_models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        table = self.frontend.models
        data = [{"id": name, "object": "model", "created": table.first_seen.get(name, 0), "owned_by": "turbine",
                 "root": m.card.tokenizer_path, "parent": m.parent, "max_model_len": m.card.context_length}
                for name, m in sorted(table.models.items())]
        return JSONResponse({"object": "list", "data": data})

    # -- generation --------------------------------------------------------------------
    async def generate(self, request: Request, kind: Kind | Literal["responses", "messages"]):
        model_name, prepared = "-", None
        try:
            if (denied := self._auth(request)) is not None:
                return denied
            body = await self._read_body(request)
            span = tracing.start("preprocess") if tracing.tracer is not None else None
            try:
                if kind == "messages":
                    messages_req, prepared = await anthropic.prepare(body, self.frontend.models, self.cfg.media)
                elif kind == "responses":
                    responses_req, prepared, state = await prepare_response(
                        body, self.frontend.models, self.cfg.media, self.frontend.records, self._owner(request))
                else:
                    batch = await preprocess_all(body, kind, self.frontend.models, self.cfg.ignore_unknown_fields,
                                                 self.cfg.max_prompt_embeds_bytes, self.cfg.media)
                    prepared = batch[0]
            except RequestError as exc:
                tracing.end(span, exc.message)
                raise
            tracing.end(span)
            if answers_images_only(prepared.model):  # an omni pipeline that ends in images only
                model_name = prepared.model.name
                if kind != "chat":
                    raise RequestError(f"the model {model_name!r} answers with images only: ask "
                                       "/v1/chat/completions or /v1/images/generations", param="model")
                answer, media_type = await image_chat(prepared, self.frontend.client, self.metrics)
                self.metrics.requests.labels(model_name, kind, "200").inc()
                return Response(answer, media_type=media_type)
            if kind == "messages":
                model_name = prepared.model.name
                run = anthropic.MessagesRun(messages_req, prepared, self.frontend.client, self.metrics.of(model_name),
                                            self.cfg.disagg, self.cfg.migration)
            elif kind == "responses":
                model_name = prepared.model.name
                run = ResponsesRun(responses_req, prepared, self.frontend.client, self.metrics.of(model_name),
                                   self.cfg.disagg, self.cfg.migration, state)
                if responses_req.background:  # generated by a task of this process; the client polls
                    queued = await self.frontend.background.start(run)
                    self.metrics.requests.labels(model_name, kind, "200").inc()
                    return JSONResponse(queued)
            else:
                model_name = prepared.model.name
                if prepared.user is not None and log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s (%s, %s) for user %r", prepared.request.request_id, kind, model_name,
                              prepared.user)
                if len(batch) > 1:  # a batch of completion prompts: each its own pipeline
                    run = BatchRun([_Run(p, self.frontend.client, self.metrics.of(model_name), self.cfg.disagg,
                                         self.cfg.migration) for p in batch])
                else:
                    run = _Run(prepared, self.frontend.client, self.metrics.of(model_name), self.cfg.disagg,
                               self.cfg.migration)
            response = await (run.stream() if prepared.stream else run.whole())
            self.metrics.requests.labels(model_name, kind, str(response.status_code)).inc()
            return response
        except FrameTooLarge as exc:  # e.g. over the NATS server's max_payload (--request-plane nats)
            self.metrics.requests.labels(model_name, kind, "413").inc()
            return self._error(RequestError(f"the request is too large to send to a worker: {exc}", status=413))
        except asyncio.CancelledError:  # the client left before the answer (a stream: before its first token)
            if prepared is not None:
                self.metrics.of(model_name).disconnects.inc()
                self.metrics.requests.labels(model_name, kind, str(CLIENT_LEFT)).inc()
            raise
        except RequestError as exc:
            if isinstance(exc, WorkerFailed):
                log.warning("request failed on its worker: %s", exc)
            if exc.param == WORKER_PARAM and prepared is not None and prepared.constraint_param:
                exc.param = prepared.constraint_param  # the engine refused the constraint: the client's field
            self.metrics.requests.labels(model_name, kind, str(exc.status)).inc()
            if isinstance(exc, ModelAsleep):  # the demand that wakes a sleeping pool's worker (the planner)
                self.metrics.asleep.labels(exc.model).inc()
            return self._error(exc)

    async def count_tokens(self, request: Request):
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens as the chat template renders it."""
        if (denied := self._auth(request)) is not None:
            return anthropic.anthropic_error(denied)
        try:
            _, prepared = await anthropic.prepare(await self._read_body(request), self.frontend.models,
                                                  self.cfg.media, count_only=True)
            return JSONResponse(anthropic.count_tokens(prepared))
        except RequestError as exc:
            return anthropic.error_response(exc.status, exc.message)

    def _error(self, exc: RequestError) -> JSONResponse:
        """The error's OpenAI-style answer; an overload 503 says when to come back (Retry-After)."""
        response = JSONResponse(exc.body(), status_code=exc.status)
        if exc.status == 503 and exc.code in RETRY_LATER:
            response.headers["retry-after"] = str(self.cfg.overload_retry_after)
        return response

    async def json_work(self, request: Request, answer):
        """`answer`: embeddings (models served by pooling workers, turbine/frontend/apis/embeddings.py) or
        images_generations (omni workers with image outputs, turbine/frontend/apis/images.py)."""
        try:
            if (denied := self._auth(request)) is not None:
                return denied
            body = await answer(await self._read_body(request), self.frontend.models, self.frontend.client,
                                self.metrics)
            return Response(body, media_type="application/json")
        except FrameTooLarge as exc:
            return self._error(RequestError(f"the request is too large to send to a worker: {exc}", status=413))
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    def _key_of(self, request: Request) -> str | None:
        """The configured API key the request carries ('Authorization: Bearer KEY', or Anthropic's
        'x-api-key: KEY'), or None."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        found = None
        for key in self.cfg.api_keys:  # every key compared, in constant time each
            if hmac.compare_digest(given.encode(), key.encode()):
                found = key
        return found

    def _auth(self, request: Request) -> JSONResponse | None:
        if not self.cfg.api_keys or self._key_of(request) is not None:
            return None
        return error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                              "authentication_error")

    def _owner(self, request: Request) -> str:
        """Whose stored responses and conversations the request sees: its API key's (all alike without keys)."""
        return owner_of(self._key_of(request)) if self.cfg.api_keys else ""

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


class _Run(Pipeline):
    """Writes a pipeline's output as a whole JSON response or an SSE stream."""

    async def whole(self) -> Response:
        return Response(self.fmt.response(await self.choices(), self.post.usage), media_type="application/json")

    async def choices(self) -> list[dict]:
        """The finished choices, whole."""
        n = self.prepared.request.sampling.n
        per_choice: list[list[Delta]] = [[] for _ in range(n)]
        with Writing(self.metrics, stream=False):
            async for delta in self.deltas:
                per_choice[delta.index].append(delta)
        return [self.fmt.choice(i, per_choice[i]) for i in range(n)]

    async def stream(self) -> EventStreamResponse:
        deltas, fmt, metrics, post = self.deltas, self.fmt, self.metrics, self.post
        # Wait for the first output before answering, so that errors found by the worker
        # (or no reachable worker) still become a proper HTTP status.
        first = await anext(deltas, None)
        sse = SseChunks(fmt, self.prepared.include_usage)
        usage = post.usage if self.prepared.continuous_usage else None

        async def body():
            with Writing(metrics) as writing:
                try:
                    for choices in fmt.opening(self.prepared.request.sampling.n):
                        yield sse.chunk(choices, usage)
                    delta = first
                    while delta is not None:
                        if delta.shown():
                            yield sse.chunk([fmt.chunk_choice(delta)], usage)
                        delta = await anext(deltas, None)
                    if self.prepared.include_usage:
                        yield sse.chunk([], post.usage)
                    writing.done = True
                except RequestError as exc:
                    log.warning("stream failed: %s", exc)
                    yield sse.error(str(exc), "worker_error" if isinstance(exc, WorkerFailed) else exc.type, exc.code)
                    writing.done = True
                finally:
                    await deltas.aclose()
            yield SseChunks.DONE

        return EventStreamResponse(body(), more_ready=self.more_ready)


class _Observed:
    """One HTTP request's request id (the client's valid X-Request-Id, else a new one: echoed in the
    response and in every log line about the request), its trace span (a child of the client's
    `traceparent`, current while it is served) and its access-log line. A generation answer gets the
    header on the response object itself: a wrapper around `send` would cost a call per streamed write."""

    __slots__ = ("scope", "access_log", "id", "header", "refusal", "status", "started", "span", "token")

    def __init__(self, scope, access_log: bool):
        self.scope, self.access_log = scope, access_log
        given = traceparent = tracestate = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
            elif name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"tracestate":
                tracestate = value.decode("latin-1")
        bad_id = given is not None and not request_id.valid(given)
        self.id = request_id.begin(None if bad_id else given).id
        request_id_var.set(self.id)  # this task's context: the request's own
        self.header = (b"x-request-id", self.id.encode())
        self.refusal = None if not bad_id else error_response(
            400, f"X-Request-Id must be 1 to {request_id.MAX_LEN} characters of letters, digits and '-._:'",
            "invalid_request_error", param="X-Request-Id")
        self.status = 0
        self.started = time.perf_counter()
        self.span = self.token = None
        if tracing.tracer is not None:
            self.span = tracing.start(f"{scope['method']} {scope['path']}", tracing.extract(traceparent, tracestate),
                                      server=True, attributes={"http.request.method": scope["method"],
                                                               "url.path": scope["path"], "turbine.request_id": self.id})
            self.token = tracing.attach(self.span)

    def respond(self, response) -> None:
        self.status = response.status_code
        response.raw_headers = [*response.raw_headers, self.header]

    def wrap(self, send):
        async def send_observed(message):
            if message["type"] == "http.response.start":
                self.status = message["status"]
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        return send_observed

    def done(self) -> None:
        scope, status = self.scope, self.status
        if self.access_log:  # under the request's span still: the line carries its trace id
            client = scope.get("client")
            ms = (time.perf_counter() - self.started) * 1e3
            access_log.log(logging.DEBUG if scope["path"] in PROBE_PATHS else logging.INFO,
                           "%s %s %s %d %.1fms", client[0] if client else "-", scope["method"], scope["path"],
                           status, ms, extra={"fields": {"client": client[0] if client else None,
                                                         "method": scope["method"], "path": scope["path"],
                                                         "status": status, "duration_ms": round(ms, 3)}})
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)
            tracing.detach(self.token)
            tracing.end(self.span, f"HTTP {status}" if status >= 500 else None)

"""The dispatch stage: take a prepared GenerateRequest to workers and stream back their raw
outputs. It chooses the worker (the model's router), tries another when one cannot be
reached, hands the prompt to a prefill worker first when the model is disaggregated, keeps
the router told of each request's first token and end, and measures TTFT and ITL. Every
attempt on some worker goes through one loop, `on_some_worker`. When a worker fails a request
in a way another worker may not (it vanished, is shutting down or overloaded), the request
migrates: it goes on on another live worker from the tokens generated so far (migration.py),
up to the model's migration limit, and the caller's stream never notices.

Output: turbine.protocol.generate.GenerateOutput chunks; failures: RequestError (the client's,
or no worker) and WorkerFailed (typed by the worker's error code)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec

from turbine import tracing
from turbine.frontend.models.busy_queue import QueueFull
from turbine.frontend.dispatch.disagg import (
    DisaggConfig,
    PrefillFailed,
    first_output_of_handoff,
    may_prefill_remotely,
    wants_remote_prefill,
)
from turbine.frontend.dispatch.encode import remote_encode, wants_remote_encode
from turbine.frontend.dispatch.migration import MigrationConfig, continuation, migration_reason, why_not_continued
from turbine.frontend.dispatch.overload import OverloadRetries
from turbine.frontend.errors import Overloaded, RequestError, WorkerFailed, failure_of
from turbine.frontend.metrics import ModelMetrics, observe_many
from turbine.frontend.models.table import ServedModel
from turbine.protocol.discovery import InstanceRecord
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
from turbine.router.policy import Router, Target
from turbine.runtime.errors import ConnectFailed, DecodeError, PeerDisconnected, RemoteError

log = logging.getLogger("turbine.frontend")

T = TypeVar("T")


def routed(router: Router, candidates: list[InstanceRecord], request: GenerateRequest, span_parent=None) -> Target:
    """The router's pick, traced as a `route` span under `span_parent` (None: not traced)."""
    if span_parent is None:
        return router.select(candidates, request)
    span = tracing.start("route", span_parent, attributes={"turbine.candidates": len(candidates)})
    try:
        target = router.select(candidates, request)
    except BaseException as exc:
        tracing.end(span, exc)
        raise
    span.set_attribute("turbine.worker", target.instance.instance_id)
    span.set_attribute("turbine.dp_rank", target.dp_rank if target.dp_rank is not None else -1)
    tracing.end(span)
    return target


async def on_some_worker(pool: list[InstanceRecord], router: Router, request: GenerateRequest,
                         attempt: Callable[[Target, GenerateRequest], Awaitable[T]], *,
                         retry: Callable[[BaseException], bool], none_left: Callable[[int], Exception],
                         first: Target | None = None, tried: set[str] | None = None, span_parent=None) -> T:
    """Runs `attempt` on a worker the router picks among `pool` (`first`, if given, is tried
    first), with the chosen data-parallel rank set on the request. A failure that `retry`
    accepts moves on to a worker not tried yet (nor in `tried`, which gains each one tried);
    when none is left, `none_left(tried)` is raised. The attempt keeps the router's
    per-request accounting. Each pick is a `route` span under `span_parent` (None: untraced)."""
    tried = set() if tried is None else tried
    while True:
        if first is not None:
            target, first = first, None
        else:
            candidates = [i for i in pool if i.instance_id not in tried]
            if not candidates:
                raise none_left(len(tried))
            target = routed(router, candidates, request, span_parent)
        tried.add(target.instance.instance_id)
        attempt_request = request
        if target.dp_rank != request.dp_rank:
            attempt_request = msgspec.structs.replace(request, dp_rank=target.dp_rank)
        try:
            return await attempt(target, attempt_request)
        except BaseException as exc:  # noqa: BLE001 - `retry` decides; the rest propagate
            if not retry(exc):
                raise
            log.warning("request %s on worker %s failed (%s: %s); trying another", request.request_id,
                        target.instance.instance_id, type(exc).__name__, exc)


class Dispatch:
    def __init__(self, model: ServedModel, client, request: GenerateRequest, metrics: ModelMetrics,
                 disagg: DisaggConfig = DisaggConfig(), migration: MigrationConfig = MigrationConfig()):
        self.model = model
        self.client = client
        self.request = request
        self.metrics = metrics
        self.disagg = disagg
        self.migration = migration
        self.limit = migration.limit_for(model.card.migration_limit)
        self.migrations_left = self.limit
        self._not_migrated: str | None = None  # why a failure was not migrated (migration on)
        self.remote_cached_tokens = 0  # prompt tokens a prefill worker found cached
        self._stream = None
        self._attempt = request  # the request as sent to the worker now streaming it
        self._instance_id: str | None = None  # that worker
        self._counted: tuple[str, int] | None = None  # (worker, prompt tokens) counted in the busy queue
        self._failed: set[str] = set()  # workers this request failed on: never tried again
        self._generated: list[int] = []  # n == 1: the tokens so far (a continuation's prompt tail)
        self._generated_count = 0  # every choice's
        self._extended = False  # the worker streaming now was sent the prompt plus generated tokens
        # Tracing (None: off): the request's span (the frontend's HTTP span), parent of this
        # stage's spans and of the workers' (its context goes with every worker request).
        self._span = tracing.current_span()
        self._prefill_span = None

    def output_ready(self) -> bool:
        """Whether the worker's next output has already arrived (so the next one comes without
        waiting): lets the writer put several events into one network write."""
        return self._stream is not None and self._stream.buffered > 0

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        """The worker's outputs until the caller stops reading. Closing this generator early
        (stop string, client gone, error) cancels the request on the worker. A worker failure
        that may migrate continues on another worker within the same iteration."""
        start = time.monotonic()
        if self.model.lora_fallback:
            self.metrics.disagg_lora_fallback.inc()  # no prefill worker holds the adapter: aggregated
        first_span = tracing.start("first_token", self._span) if self._span is not None else None
        try:
            if wants_remote_encode(self.model, self.request):  # images to embeddings on an encode worker first
                self.request = await remote_encode(self.model, self.client, self.request, self.disagg)
            first = await self._open(self.request)
        except BaseException as exc:
            tracing.end(first_span, exc)
            raise
        router = self.model.router
        last_token_at = None
        attempt_started = False  # the router was told of this attempt's first token
        keep_tokens = self.limit > 0 and self.request.sampling.n == 1  # a continuation's prompt tail
        # Per-token gaps, observed when the request ends: a histogram takes a lock per observation.
        gaps: list[float] = []
        chunk = first
        try:
            while True:
                if chunk.token_ids:
                    now = time.monotonic()
                    if last_token_at is None:
                        self.metrics.ttft.observe(now - start)
                        if first_span is not None:
                            tracing.end(first_span)
                            first_span = None
                    else:
                        gaps.append((now - last_token_at) / len(chunk.token_ids))
                    if not attempt_started:
                        router.first_token(self._attempt.request_id)
                        attempt_started = True
                    last_token_at = now
                    self._generated_count += len(chunk.token_ids)
                    if keep_tokens:
                        self._generated += chunk.token_ids
                if chunk.usage is not None and self._extended:
                    # The continuation's prompt holds generated tokens: the client's prompt is the original.
                    prompt = len(self.request.token_ids)
                    if self.request.images:  # the engine widened the images: its count less the generated part
                        prompt = chunk.usage.prompt_tokens - (len(self._attempt.token_ids) - prompt)
                    chunk.usage = Usage(prompt_tokens=prompt, completion_tokens=chunk.usage.completion_tokens,
                                        cached_tokens=min(chunk.usage.cached_tokens or 0, prompt))
                yield chunk
                try:
                    chunk = await anext(self._stream)
                except StopAsyncIteration:
                    return
                except (RemoteError, PeerDisconnected, DecodeError) as exc:
                    chunk = await self._migrate(exc)
                    attempt_started = False
        finally:
            tracing.end(first_span, "ended before the first token")
            router.finished(self._attempt.request_id)
            self._uncount()
            if self._stream is not None:
                await self._stream.aclose()
            observe_many(self.metrics.itl, gaps)

    # -- migration --------------------------------------------------------------------
    def _failure(self, exc: BaseException) -> RequestError:
        """A mid-stream failure as the client's error."""
        if isinstance(exc, RemoteError):
            return failure_of(exc, self._instance_id)
        if isinstance(exc, DecodeError):
            return WorkerFailed(f"worker {self._instance_id} sent an undecodable output mid-stream: {exc}")
        return WorkerFailed(f"worker {self._instance_id} failed mid-stream: {exc}")

    def _may_migrate(self, exc: BaseException | None) -> bool:
        """Whether the request may move on after `exc` (counted as a migration if so). When
        migration is on but this request may not move, `_not_migrated` says why."""
        reason = migration_reason(exc)
        if reason is None or self.limit == 0:
            return False
        request_id, model = self.request.request_id, self.model.name
        why_not = why_not_continued(self.request, self._generated_count, self.migration.max_seq_len)
        if why_not is None and self.migrations_left <= 0:
            self.metrics.migration_limit_exceeded.inc()
            why_not = f"the migration limit ({self.limit}) is reached"
        if why_not is not None:
            log.warning("request %s of model %r not migrated after %s: %s", request_id, model, reason, why_not)
            self._not_migrated = why_not
            return False
        self.migrations_left -= 1
        self.metrics.migrations(reason).inc()
        log.warning("request %s of model %r migrates after %s (%d tokens generated, %d migrations left)",
                    request_id, model, reason, self._generated_count, self.migrations_left)
        return True

    async def _migrate(self, exc: BaseException) -> GenerateOutput:
        """Ends the failed attempt and continues the request on another worker; its first
        output. Raises the client's error when the request may not migrate."""
        self._failed.add(self._instance_id)
        self.model.router.finished(self._attempt.request_id)
        self._uncount()
        stream, self._stream = self._stream, None
        await stream.aclose()
        if not self._may_migrate(exc):
            failure = self._failure(exc)
            if self._not_migrated is not None:
                failure.message = f"{failure.message} (not migrated: {self._not_migrated})"
                failure.args = (failure.message,)
            raise failure from exc
        self._extended = bool(self._generated)
        return await self._open(continuation(self.request, self._generated, len(self._failed)))

    # -- opening the stream -----------------------------------------------------------
    async def _open(self, request: GenerateRequest) -> GenerateOutput:
        """Open a stream on some live instance and return its first chunk. An instance that
        cannot be reached is skipped (it may have died since the last discovery snapshot);
        one that fails before its first output is skipped as a migration would be.
        With prefill workers, the prompt's KV is computed on one of them first."""
        model = self.model
        pool = [i for i in model.instances if i.instance_id not in self._failed] if self._failed else model.instances
        if model.busy_queue is not None and not self._failed:
            # Busy thresholds (busy_queue.py): only workers below them, after waiting while none is. A
            # continuation after a failure (self._failed) does not queue again.
            pool = await self._admitted(model)
        chosen = None  # with prefill workers: the decode instance, chosen first
        if may_prefill_remotely(model, request) and pool:
            chosen = routed(model.router, pool, request, self._span)
            caches = model.decode_caches
            cached = caches.cached_tokens(chosen.instance.instance_id, request.token_ids) if caches else 0
            if wants_remote_prefill(model, request, self.disagg, cached):
                try:
                    params = await self._remote_prefill(request)
                except PrefillFailed as exc:
                    log.warning("request %s: %s; the decode worker prefills it", request.request_id, exc)
                    self.metrics.local_prefills.inc()
                except BaseException:
                    model.router.finished(request.request_id)  # it never reached the decode worker
                    raise
                else:
                    request = msgspec.structs.replace(request, kv_transfer_params=params)
                    self.metrics.remote_prefills.inc()
        overload = OverloadRetries(model.name, self.metrics)  # an overloaded worker's refusal: try another
        return await on_some_worker(
            pool, model.router, request, self._first_output, first=chosen, tried=set(self._failed),
            span_parent=self._span,
            # A refusal as overloaded comes before any work: trying another worker costs no migration.
            retry=lambda exc: (isinstance(exc, ConnectFailed) or overload.refused(exc)
                               or overload.adapter_not_loaded(exc) or self._may_migrate(exc.__cause__)),
            none_left=overload.none_left)

    async def _admitted(self, model) -> list[InstanceRecord]:
        queue, start = model.busy_queue, time.monotonic()
        self.metrics.queued.inc()
        try:
            pool = await queue.admit(model.name, len(self.request.token_ids))
        except QueueFull as exc:
            self.metrics.queue_full.inc()
            raise Overloaded(f"every worker of model {model.name!r} is busy and the queue is full ({exc}; "
                             f"--busy-queue-size); retry later") from None
        finally:
            self.metrics.queued.dec()
        self.metrics.queue_wait.observe(time.monotonic() - start)
        return pool

    def _uncount(self) -> None:
        if self._counted is not None:
            self.model.busy_queue.remove(*self._counted)
            self._counted = None

    async def _first_output(self, target: Target, request: GenerateRequest) -> GenerateOutput:
        inst = target.instance
        if self.model.busy_queue is not None:
            # Counted from here (before any await: the next waiter woken sees it) to the attempt's end.
            self._counted = (inst.instance_id, len(request.token_ids))
            self.model.busy_queue.add(*self._counted)
        stream = self.client.stream(inst.address, inst.endpoint, request, GenerateOutput,
                                    trace=tracing.carrier(self._span))
        handoff = request.kv_transfer_params is not None
        try:
            first = await (first_output_of_handoff(stream) if handoff else anext(stream))
        except BaseException as exc:
            # The request never got going on this instance: the router stops counting it.
            self.model.router.finished(request.request_id)
            self._uncount()
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) and not handoff:
                # (a hand-off cancels its own stream once the KV has moved)
                await stream.aclose()  # the client left before the first token: cancel on the worker
            if isinstance(exc, RemoteError):
                if migration_reason(exc) is not None:
                    self._failed.add(inst.instance_id)
                raise failure_of(exc, inst.instance_id) from exc
            if isinstance(exc, PeerDisconnected):
                self._failed.add(inst.instance_id)
                raise WorkerFailed(f"worker {inst.instance_id} failed: {exc}") from exc
            if isinstance(exc, StopAsyncIteration):
                raise WorkerFailed(f"worker {inst.instance_id} ended the stream without output") from None
            if isinstance(exc, DecodeError):  # a buggy worker or another wire version: not the client's fault
                raise WorkerFailed(f"worker {inst.instance_id} sent an undecodable output: {exc}") from exc
            raise
        self._stream = stream
        self._attempt, self._instance_id = request, inst.instance_id
        if self.model.decode_caches is not None:
            self.model.decode_caches.served(inst.instance_id, request.token_ids)  # its KV is there now
        return first

    # -- disaggregated hand-off -------------------------------------------------------
    async def _remote_prefill(self, request: GenerateRequest) -> dict:
        """Runs the prompt on a prefill worker (max_tokens 1) and returns the KV connector's
        parameters for the decode worker. A prefill worker that is unreachable, dies, errs or
        times out is skipped for another; when none is left, PrefillFailed. Cancelling
        cancels the prefill."""
        model = self.model
        stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=None)
        prefill_req = msgspec.structs.replace(request, stop=stop)
        span = self._prefill_span = tracing.start("prefill", self._span, client=True) if self._span else None
        try:
            params = await on_some_worker(
                model.prefill_instances, model.prefill_router, prefill_req, self._prefill_on,
                # Anything but the client's own error: the decode worker can still prefill it.
                retry=lambda exc: isinstance(exc, (ConnectFailed, PeerDisconnected, PrefillFailed, TimeoutError,
                                                   WorkerFailed)),
                none_left=lambda tried: PrefillFailed(f"no prefill worker left to try ({tried} failed)"),
                span_parent=span)
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        tracing.end(span)
        return params

    async def _prefill_on(self, target: Target, request: GenerateRequest) -> dict:
        model, inst = self.model, target.instance
        queued, tokens = model.prefill_queued_tokens, len(request.token_ids)
        queued[inst.instance_id] = queued.get(inst.instance_id, 0) + tokens
        try:
            return await asyncio.wait_for(self._prefill_stream(inst, request), self.disagg.prefill_timeout_s)
        finally:
            queued[inst.instance_id] -= tokens
            model.prefill_router.finished(request.request_id)

    async def _prefill_stream(self, inst: InstanceRecord, request: GenerateRequest) -> dict:
        router = self.model.prefill_router
        try:
            async with self.client.stream(inst.address, inst.endpoint, request, GenerateOutput,
                                          trace=tracing.carrier(self._prefill_span)) as stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        router.first_token(request.request_id)
                    if chunk.finish_reason is None:
                        continue
                    if not chunk.kv_transfer_params:
                        raise PrefillFailed("the prefill worker returned no KV transfer parameters")
                    self.remote_cached_tokens = chunk.usage.cached_tokens or 0 if chunk.usage else 0
                    return chunk.kv_transfer_params
        except RemoteError as exc:
            raise failure_of(exc, inst.instance_id) from exc  # a bad request is the client's: not retried
        raise PrefillFailed("the prefill worker ended the stream without finishing")

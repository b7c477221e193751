"""One request's trip to a worker: route, stream token ids, detokenize per choice, apply
stop strings, and count usage. Formatting (chat vs completions, SSE vs JSON) is not here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from turbine.frontend.detokenizer import IncrementalDetokenizer
from turbine.frontend.disagg import (
    DisaggConfig,
    PrefillFailed,
    first_output_of_handoff,
    may_prefill_remotely,
    remote_prefill,
    wants_remote_prefill,
)
from turbine.frontend.metrics import ModelMetrics
from turbine.frontend.models import ServedModel
from turbine.frontend.openai_schemas import RequestError
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateOutput, GenerateRequest
from turbine.runtime.errors import ConnectFailed, PeerDisconnected, RemoteError

log = logging.getLogger("turbine.frontend")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class UsageCount:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


class WorkerFailed(Exception):
    """The worker failed or vanished after the request reached it (HTTP 502 / SSE error)."""


def failure_of(exc: RemoteError, instance_id: str | None = None) -> Exception:
    """A worker's typed error as what the frontend raises: bad input is the client's (400)."""
    if exc.code == codes.INVALID_REQUEST:
        return RequestError(f"invalid request: {exc.message}")
    where = f"worker {instance_id}" if instance_id else "worker"
    return WorkerFailed(f"{where} failed ({exc.code}): {exc.message}")


class Generation:
    def __init__(self, model: ServedModel, client, request: GenerateRequest, *, stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool, metrics: ModelMetrics,
                 disagg: DisaggConfig = DisaggConfig()):
        self.model = model
        self.disagg = disagg
        self.client = client
        self.request = request
        self.metrics = metrics
        n = request.sampling.n
        self.detoks = [
            IncrementalDetokenizer(model.tokenizer, request.token_ids, stop=stop,
                                   skip_special_tokens=skip_special_tokens,
                                   include_stop_str_in_output=include_stop_str_in_output)
            for _ in range(n)
        ]
        self.finished = [False] * n
        self.usage = UsageCount(prompt_tokens=len(request.token_ids))
        self._stream = None

    async def _open(self) -> GenerateOutput:
        """Open a stream on some live instance and return its first chunk. An instance that
        cannot be reached is skipped (it may have died since the last discovery snapshot).
        With prefill workers, the prompt's KV is computed on one of them first."""
        request = self.request
        model = self.model
        chosen = None  # with prefill workers: the decode instance, chosen first
        if may_prefill_remotely(model, request) and model.instances:
            chosen = model.router.select(model.instances, request)
            caches = model.decode_caches
            cached = caches.cached_tokens(chosen.instance.instance_id, request.token_ids) if caches else 0
            if wants_remote_prefill(model, request, self.disagg, cached):
                try:
                    params, self.usage.cached_tokens = await remote_prefill(model, self.client, request,
                                                                            self.disagg)
                except PrefillFailed as exc:
                    log.warning("request %s: %s; the decode worker prefills it", request.request_id, exc)
                    self.metrics.local_prefills.inc()
                except BaseException:
                    model.router.finished(request.request_id)  # it never reached the decode worker
                    raise
                else:
                    request = msgspec.structs.replace(request, kv_transfer_params=params)
                    self.metrics.remote_prefills.inc()
        tried: set[str] = set()
        while True:
            router = model.router
            if chosen is not None:
                target, chosen = chosen, None
            else:
                candidates = [i for i in model.instances if i.instance_id not in tried]
                if not candidates:
                    raise RequestError(f"no live worker for model {model.name!r}", param="model",
                                       status=503, type_="service_unavailable")
                target = router.select(candidates, request)
            inst = target.instance
            if target.dp_rank != request.dp_rank:
                request = msgspec.structs.replace(request, dp_rank=target.dp_rank)
            stream = self.client.stream(inst.address, inst.endpoint, request, GenerateOutput)
            handoff = request.kv_transfer_params is not None
            try:
                first = await (first_output_of_handoff(stream) if handoff else anext(stream))
            except BaseException as exc:
                # The request never got going on this instance: the router stops counting it.
                router.finished(self.request.request_id)
                if isinstance(exc, ConnectFailed):
                    log.warning("worker %s at %s unreachable; trying another", inst.instance_id, inst.address)
                    tried.add(inst.instance_id)
                    continue
                if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                    if not handoff:  # (a hand-off cancels its own stream once the KV has moved)
                        await stream.aclose()  # the client left before the first token: cancel on the worker
                    raise
                if isinstance(exc, RemoteError):
                    raise failure_of(exc, inst.instance_id) from exc
                if isinstance(exc, PeerDisconnected):
                    raise WorkerFailed(f"worker {inst.instance_id} failed: {exc}") from exc
                if isinstance(exc, StopAsyncIteration):
                    raise WorkerFailed(f"worker {inst.instance_id} ended the stream without output") from None
                raise
            self._stream = stream
            if model.decode_caches is not None and not (first.finish_reason or "").startswith("error"):
                model.decode_caches.served(inst.instance_id, request.token_ids)  # its KV is there now
            return first

    def output_ready(self) -> bool:
        """Whether the worker's next output has already arrived (so the next event comes
        without waiting): lets a writer put several events into one network write."""
        return self._stream is not None and self._stream.buffered > 0

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        """The request's text deltas. Outputs that arrived together are merged into one delta
        per choice (as vLLM's server does when it falls behind): the client gets the same
        text, sooner, in fewer events, and neither side formats and parses one per token."""
        held: ChoiceDelta | None = None
        async with contextlib.aclosing(self._deltas()) as deltas:  # closing us cancels the request now
            async for delta in deltas:
                if held is not None and _mergeable(held, delta):
                    held = ChoiceDelta(held.index, held.text + delta.text, finish_reason=delta.finish_reason)
                else:
                    if held is not None:
                        yield held
                    held = delta
                if not self.output_ready():
                    yield held
                    held = None
        if held is not None:
            yield held

    async def _deltas(self) -> AsyncIterator[ChoiceDelta]:
        start = time.monotonic()
        chunk = await self._open()
        first_token_at = last_token_at = None
        try:
            while True:
                if chunk.finish_reason and chunk.finish_reason.startswith("error"):
                    message = chunk.finish_reason.removeprefix("error: ")
                    if message.startswith("invalid request"):
                        raise RequestError(message)
                    raise WorkerFailed(message)
                if chunk.token_ids:
                    now = time.monotonic()
                    if first_token_at is None:
                        first_token_at = now
                        self.metrics.ttft.observe(now - start)
                        self.model.router.first_token(self.request.request_id)
                    elif last_token_at is not None:
                        self.metrics.itl.observe((now - last_token_at) / len(chunk.token_ids))
                    last_token_at = now
                delta = self._apply(chunk)
                if delta is not None:
                    yield delta
                if all(self.finished):
                    return
                try:
                    chunk = await anext(self._stream)
                except StopAsyncIteration:
                    raise WorkerFailed("worker ended the stream before every choice finished") from None
                except RemoteError as exc:
                    raise failure_of(exc) from exc
                except PeerDisconnected as exc:
                    raise WorkerFailed(f"worker failed mid-stream: {exc}") from exc
        finally:
            # Closing early (stop string, client gone, error) cancels the worker's request.
            self.model.router.finished(self.request.request_id)
            await self._stream.aclose()
            self.metrics.output_tokens.inc(self.usage.completion_tokens)

    def _apply(self, chunk: GenerateOutput) -> ChoiceDelta | None:
        i = chunk.index
        if self.finished[i]:
            return None
        detok = self.detoks[i]
        self.usage.completion_tokens += len(chunk.token_ids)
        text = detok.push(chunk.token_ids) if chunk.token_ids else ""
        delta = ChoiceDelta(index=i, text=text)
        if chunk.log_probs is not None:
            tops = chunk.top_logprobs or [[] for _ in chunk.token_ids]
            delta.logprobs = [TokenLogprob(t, lp, [(x.token_id, x.logprob) for x in top])
                              for t, lp, top in zip(chunk.token_ids, chunk.log_probs, tops)]
        if detok.stopped:
            delta.finish_reason = "stop"
        elif chunk.finish_reason == "cancelled":
            raise WorkerFailed("the worker cancelled the request")
        elif chunk.finish_reason is not None:
            delta.text += detok.flush()
            delta.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage.cached_tokens = max(self.usage.cached_tokens, chunk.usage.cached_tokens or 0)
        if delta.finish_reason is not None:
            self.finished[i] = True
        return delta


def _mergeable(held: ChoiceDelta, delta: ChoiceDelta) -> bool:
    return (held.index == delta.index and held.finish_reason is None
            and not held.logprobs and not delta.logprobs)

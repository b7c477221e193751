"""One generation request's trip through the stages after preprocess: dispatch (workers'
outputs) -> postprocess (Deltas) -> the format for its endpoint; and what every API's writer of
the result (JSON or SSE) counts while it writes (`Writing`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from turbine.frontend.deltas import Delta, UsageCount
from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.dispatch.migration import MigrationConfig
from turbine.frontend.dispatch.stage import Dispatch
from turbine.frontend.metrics import ModelMetrics
from turbine.frontend.postprocess.format import FORMATS
from turbine.frontend.postprocess.stage import Postprocess, TextPostprocess
from turbine.frontend.preprocess.stage import Prepared


class Writing:
    """One response being written, as every API's writer counts it: in flight while it is, its
    duration, and (a stream) a disconnect when it ends before `done` is set: the client left."""

    __slots__ = ("metrics", "started", "done")

    def __init__(self, metrics: ModelMetrics, stream: bool = True):
        self.metrics = metrics
        self.done = not stream  # a whole response's client leaving is seen by the http stage's ClientWatch

    def __enter__(self) -> Writing:
        self.started = time.monotonic()
        self.metrics.inflight.inc()
        return self

    def __exit__(self, *exc) -> None:
        self.metrics.inflight.dec()
        self.metrics.duration.observe(time.monotonic() - self.started)
        if not self.done:
            self.metrics.disconnects.inc()


class Pipeline:
    def __init__(self, prepared: Prepared, client, metrics: ModelMetrics, disagg: DisaggConfig = DisaggConfig(),
                 migration: MigrationConfig = MigrationConfig()):
        model, request = prepared.model, prepared.request
        self.prepared = prepared
        self.metrics = metrics
        # The worker counts the prompt of text mode and embeddings, and of images (the engine widens them).
        self._worker_counts_prompt = request.text is not None or request.prompt_embeds is not None \
            or bool(request.images)
        if not request.images:
            metrics.input_tokens.inc(len(request.token_ids))
        self.dispatch = Dispatch(model, client, request, metrics, disagg, migration)
        self.post = (TextPostprocess(request.sampling.n, prepared.output.parsers) if request.text is not None else
                     Postprocess(model.tokenizer, request.token_ids, request.sampling.n, prepared.output,
                                 parsers=prepared.output.parsers, prompt_from_worker=bool(request.images)))
        self.fmt = FORMATS[prepared.kind](model.tokenizer, model.name, request.request_id,
                                          request.output.logprobs is not None, prepared.echo)
        self.fmt.prompt_logprobs = self.post.prompt_logprobs
        self.deltas: AsyncIterator[Delta] = self.post.deltas(self.dispatch.outputs(), self.dispatch.output_ready,
                                                             self._done)

    @property
    def usage(self) -> UsageCount:
        return self.post.usage

    def more_ready(self) -> bool:
        """Whether the next delta comes without waiting (the writer then holds this one back)."""
        return self.dispatch.output_ready() or all(self.post.finished)

    def _done(self, usage: UsageCount) -> None:
        # A prompt prefilled remotely was (partly) cached on the prefill worker.
        usage.cached_tokens = max(usage.cached_tokens, self.dispatch.remote_cached_tokens)
        if self._worker_counts_prompt:
            self.metrics.input_tokens.inc(usage.prompt_tokens)
        self.metrics.output_tokens.inc(usage.completion_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.input_sequence.observe(usage.prompt_tokens)
        self.metrics.output_sequence.observe(usage.completion_tokens)

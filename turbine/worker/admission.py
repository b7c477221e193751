"""Overload control on a worker: refuse a new request, before any engine work, when the
worker's queue is past a bound (--max-waiting-requests, --max-queued-prefill-tokens). The
refusal is the typed error OVERLOADED, which the frontend retries on another worker.

The queue is what the handler has accepted and the engine has not started answering: requests
without their first output yet (waiting for admission to the running batch, or prefilling), and
the prompt tokens those still have to compute. It is counted here, in the handler, for both
engines alike (the vLLM worker and the mocker): the count changes the moment a request arrives,
where the engine's own counts (its stat loggers, the load reports) trail by a step, so a burst
arriving between two steps would all get in. A decode worker's request whose KV comes from a
prefill worker queues no prefill tokens."""

from __future__ import annotations

from turbine.protocol import errors as codes
from turbine.runtime.errors import RequestFailed
from turbine.worker.worker_metrics import WorkerMetrics


class Admission:
    """One worker's queue and its bounds (None: that bound is off)."""

    def __init__(self, max_waiting_requests: int | None, max_queued_prefill_tokens: int | None,
                 metrics: WorkerMetrics | None = None):
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_prefill_tokens = max_queued_prefill_tokens
        self.metrics = metrics
        self.waiting = 0  # requests accepted, no first output yet
        self.queued_prefill_tokens = 0  # their prompt tokens

    def admit(self, prefill_tokens: int) -> Ticket:
        """A ticket for a request with this many prompt tokens to compute, or RequestFailed(OVERLOADED).
        One prompt larger than the token bound is still taken when nothing else is queued:
        otherwise it could never run."""
        reason = None
        if self.max_waiting_requests is not None and self.waiting >= self.max_waiting_requests:
            reason = "waiting_requests"
            detail = f"{self.waiting} requests waiting (--max-waiting-requests {self.max_waiting_requests})"
        elif (self.max_queued_prefill_tokens is not None and self.waiting
              and self.queued_prefill_tokens + prefill_tokens > self.max_queued_prefill_tokens):
            reason = "queued_prefill_tokens"
            detail = (f"{self.queued_prefill_tokens} prompt tokens queued, {prefill_tokens} more would pass "
                      f"--max-queued-prefill-tokens {self.max_queued_prefill_tokens}")
        if reason is not None:
            if self.metrics is not None:
                self.metrics.overload_rejection(reason)
            raise RequestFailed(f"worker overloaded: {detail}", code=codes.OVERLOADED)
        return Ticket(self, prefill_tokens)

    def _moved(self, requests: int, tokens: int) -> None:
        self.waiting += requests
        self.queued_prefill_tokens += tokens
        if self.metrics is not None:
            self.metrics.waiting_requests.set(self.waiting)
            self.metrics.queued_prefill_tokens.set(self.queued_prefill_tokens)


class Ticket:
    """A request's place in the queue: it leaves at its first output (`started`) or when the
    request ends, whichever comes first (`release`, idempotent; also a context manager)."""

    __slots__ = ("_admission", "_tokens", "_queued")

    def __init__(self, admission: Admission, prefill_tokens: int):
        self._admission, self._tokens, self._queued = admission, prefill_tokens, True
        admission._moved(1, prefill_tokens)

    def started(self) -> None:
        if self._queued:
            self._queued = False
            self._admission._moved(-1, -self._tokens)

    release = started

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

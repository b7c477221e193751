"""A worker's OVERLOADED refusal (it comes before any work, turbine/worker/admission.py) sends the
request to another worker; when every worker refused, the client gets 503 with Retry-After. A
worker's ADAPTER_NOT_LOADED refusal (the adapter was unloaded after the frontend last looked) is
retried the same way; when no worker holds the adapter any more, 404 as for any unknown model."""

from __future__ import annotations

from turbine.frontend.errors import Overloaded, RequestError, WorkerFailed
from turbine.frontend.metrics import ModelMetrics
from turbine.protocol import errors as codes


class OverloadRetries:
    """One request's dispatch: counts the workers that refused it (overloaded, or without its
    adapter), and makes the error for when no worker is left to try."""

    def __init__(self, model: str, metrics: ModelMetrics):
        self.model, self.metrics = model, metrics
        self.refusals = 0
        self.adapter_gone = 0  # workers that no longer held the request's adapter

    def adapter_not_loaded(self, exc: BaseException) -> bool:
        """Whether `exc` says the worker no longer holds the request's adapter (unloaded after the
        frontend's last look at discovery): another worker may still hold it, at no migration."""
        if isinstance(exc, WorkerFailed) and exc.code == codes.ADAPTER_NOT_LOADED:
            self.adapter_gone += 1
            return True
        return False

    def refused(self, exc: BaseException) -> bool:
        """Whether `exc` is a worker's overload refusal (counted; the request may go elsewhere)."""
        if isinstance(exc, WorkerFailed) and exc.code == codes.OVERLOADED:
            self.refusals += 1
            self.metrics.worker_overloaded.inc()
            return True
        return False

    def none_left(self, tried: int) -> RequestError:
        if self.refusals:
            self.metrics.overloaded.inc()
            return Overloaded(f"every worker of model {self.model!r} is overloaded "
                              f"({self.refusals} of {tried} refused the request); retry later")
        if self.adapter_gone:  # the adapter was unloaded everywhere the frontend thought it was
            return RequestError(f"the model {self.model!r} does not exist or has no live worker", param="model",
                                status=404, code="model_not_found")
        return RequestError(f"no live worker for model {self.model!r}", param="model", status=503,
                            type_="service_unavailable")

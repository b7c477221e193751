"""The frontend's two kinds of failure and the HTTP status each becomes. Raised by any stage;
mapped to a response in one place (the http stage) and to an SSE error event once a stream
has started."""

from __future__ import annotations

from turbine.protocol import errors as codes
from turbine.runtime.errors import RemoteError

# A worker's error code -> (HTTP status, OpenAI error type). Codes not listed: 502 worker_error.
_STATUS_OF_CODE = {
    codes.INVALID_REQUEST: (400, "invalid_request_error"),
    codes.OVERLOADED: (503, "service_unavailable"),
    codes.SHUTTING_DOWN: (503, "service_unavailable"),
    codes.ADAPTER_NOT_LOADED: (404, "invalid_request_error"),
}
_WORKER_ERROR = (502, "worker_error")


class RequestError(Exception):
    """The client's error, or one the client can act on: an OpenAI-style body with this status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class WorkerFailed(RequestError):
    """The request failed on (or with) its worker after reaching it. `code` is the worker's
    (turbine.protocol.errors) or None when the worker vanished without saying why."""

    def __init__(self, message: str, code: str | None = None):
        status, type_ = _STATUS_OF_CODE.get(code, _WORKER_ERROR)
        super().__init__(message, status=status, type_=type_, code=code)


class Overloaded(RequestError):
    """Every worker refused the request as overloaded, or the frontend is at its own bound:
    503 (the server is saturated, not the client over a rate limit: OpenAI answers an
    overloaded engine with 503 too) with a Retry-After header (the http stage adds it)."""

    def __init__(self, message: str):
        super().__init__(message, status=503, type_="service_unavailable", code=codes.OVERLOADED)


class ModelAsleep(RequestError):
    """Every worker of the model sleeps (/engine/sleep; their cards say so): 503 with a Retry-After
    header, as for an overload, since the model exists and may wake (a 404 would say it does not)."""

    CODE = "model_asleep"

    def __init__(self, model: str):
        super().__init__(f"the model {model!r} is asleep: every worker of it sleeps; retry later", param="model",
                         status=503, type_="service_unavailable", code=self.CODE)
        self.model = model


# A 503 with these codes says when to come back (Retry-After: the frontend's --overload-retry-after).
RETRY_LATER = (codes.OVERLOADED, ModelAsleep.CODE)


def failure_of(exc: RemoteError, instance_id: str | None = None) -> RequestError:
    """A worker's typed error as the frontend's: bad input is the client's (400), the rest
    keep the worker's code. No message is parsed."""
    if exc.code == codes.INVALID_REQUEST:
        return RequestError(f"invalid request: {exc.message}", param=exc.error.param)
    where = f"worker {instance_id}" if instance_id else "worker"
    return WorkerFailed(f"{where} failed ({exc.code}): {exc.message}", exc.code)

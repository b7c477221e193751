"""A worker's failure as it crosses the request plane: a code the frontend maps to an HTTP
status (and, later, to a migration decision), a message for the client, and whether the
same request may be tried on another worker.

It travels in the request plane's ERROR frame; the caller's stream raises it as
`turbine.runtime.errors.RemoteError`, whose `.error` is this struct. Nobody parses messages.
"""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1

# The codes, and whether a request that failed with one may be sent to another worker.
INVALID_REQUEST = "invalid_request"  # the request itself is wrong: it would fail anywhere
OVERLOADED = "overloaded"  # this worker cannot take it now
SHUTTING_DOWN = "shutting_down"  # this worker is draining
ENGINE_FAILURE = "engine_failure"  # the engine died or failed this request
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a disaggregated hand-off could not move the KV
CANCELLED = "cancelled"  # the worker's engine aborted the request (not the client)
UNKNOWN_ENDPOINT = "unknown_endpoint"  # the worker serves no such endpoint
INTERNAL = "internal"  # a bug in the worker's handler: it would likely fail anywhere
# The request names a LoRA adapter this worker does not hold (any more): the frontend's view of
# discovery lags an unload; another worker may still hold it.
ADAPTER_NOT_LOADED = "adapter_not_loaded"

RETRYABLE = {
    INVALID_REQUEST: False, OVERLOADED: True, SHUTTING_DOWN: True, ENGINE_FAILURE: True,
    KV_TRANSFER_FAILED: True, CANCELLED: True, UNKNOWN_ENDPOINT: True, INTERNAL: False,
    ADAPTER_NOT_LOADED: True,
}


class WorkerError(msgspec.Struct, omit_defaults=True, kw_only=True):
    # A plain str (not a Literal) so that a newer peer's new codes decode, as INTERNAL would.
    code: str
    message: str
    retryable: bool = False
    # The GenerateRequest field an INVALID_REQUEST is about, if one (the frontend names the client's field).
    param: str | None = None
    v: int = WIRE_VERSION

    @classmethod
    def of(cls, code: str, message: str) -> WorkerError:
        """The error with the code's usual retry rule."""
        return cls(code=code, message=message, retryable=RETRYABLE.get(code, False))

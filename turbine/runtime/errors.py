"""Exceptions raised by the runtime (codec, request plane, discovery), and the one a worker's
handler raises to fail a request with a typed error."""

from __future__ import annotations

from turbine.protocol import errors as codes
from turbine.protocol.errors import WorkerError


class DecodeError(ValueError):
    """Bytes could not be decoded into the expected struct; the message names the field."""


class EventPlaneError(Exception):
    """The event plane cannot be used as configured (e.g. the NATS server is unreachable)."""


class RequestPlaneError(Exception):
    """Base class for request-plane failures seen by a client stream."""


class ConnectFailed(RequestPlaneError):
    """The address could not be reached (refused, unreachable or connect timeout)."""


class PeerDisconnected(RequestPlaneError):
    """The connection dropped while the stream was open; the request may be migrated."""


class RemoteError(RequestPlaneError):
    """The server answered the stream with an error frame: `error` says what and whether the
    request may be tried elsewhere."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(error.message)
        self.error = error
        self.message = error.message

    @property
    def code(self) -> str:
        return self.error.code


class RequestFailed(Exception):
    """Raised by a request-plane handler to fail its stream with a typed error (the server
    sends it in the ERROR frame). Any other exception reaches the caller as INTERNAL."""

    code = codes.INTERNAL

    def __init__(self, message: str, code: str | None = None, retryable: bool | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.error = WorkerError(code=self.code, message=message, param=param,
                                 retryable=codes.RETRYABLE.get(self.code, False) if retryable is None else retryable)


class InvalidRequest(RequestFailed, ValueError):
    """The request is wrong (it would fail on any worker): HTTP 400 at the frontend."""

    code = codes.INVALID_REQUEST


class AdapterNotLoaded(RequestFailed):
    """The request's `lora_name` is not loaded on this worker (unloaded since the frontend routed
    it there): the frontend tries a worker that still holds it, else answers 404."""

    code = codes.ADAPTER_NOT_LOADED

    def __init__(self, lora_name: str) -> None:
        super().__init__(f"lora_name {lora_name!r}: no such LoRA adapter is loaded on this worker", param="lora_name")


class FrameTooLarge(RequestPlaneError):
    """An outgoing frame exceeds max_frame_bytes (the peer would drop the connection)."""


class DiscoveryError(Exception):
    """The discovery backend could not be started or reached."""

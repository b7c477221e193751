"""The request id of an HTTP request: the client's `X-Request-Id` when it is a sane one (1 to 128
characters of letters, digits and `-._:`; anything else is a 400 naming the header), else one
generated here (32 hex digits). It is echoed in the response's `X-Request-Id` header and is in
every log line about the request (turbine/logging_setup.py's contextvar).

Each worker request gets its own id, which the worker logs: the request id itself (so the OpenAI
`id`, e.g. `chatcmpl-<request id>`, names it), `<request id>-<k>` for the k-th further prompt of
a batch; with a client's id, `<client id>-<12 hex>`, as clients may reuse an id and the workers
and routers need unique ones. Either way a grep for the request id finds every line."""

from __future__ import annotations

import os
import re
from contextvars import ContextVar

HEADER = "x-request-id"
MAX_LEN = 128
_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_LEN)


class RequestIds:
    """One HTTP request's id and the ids of its worker requests."""

    __slots__ = ("id", "_given", "_issued")

    def __init__(self, given: str | None = None):
        self._given = given is not None
        self.id = given if given is not None else os.urandom(16).hex()
        self._issued = 0

    def next(self) -> str:
        self._issued += 1
        if self._given:
            return f"{self.id}-{os.urandom(6).hex()}"
        return self.id if self._issued == 1 else f"{self.id}-{self._issued - 1}"


_current: ContextVar[RequestIds | None] = ContextVar("turbine_request_ids", default=None)


def valid(value: str) -> bool:
    return _VALID.fullmatch(value) is not None


def begin(given: str | None) -> RequestIds:
    """The ids of the HTTP request this task serves (`given`: a valid client id, or None)."""
    ids = RequestIds(given)
    _current.set(ids)
    return ids


def worker_request_id() -> str:
    """A new worker request's id (outside an HTTP request, e.g. in tests: a random one)."""
    ids = _current.get()
    return ids.next() if ids is not None else os.urandom(16).hex()

"""Request-plane wire frames: many request/response streams multiplexed on one TCP connection.

On the wire each frame is a 4-byte big-endian length followed by the msgpack of a `Frame`.
"""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1

# Frame kinds. Client -> server: REQUEST, CANCEL. Server -> client: CHUNK, END, ERROR.
REQUEST = "request"  # opens stream `stream_id`; payload = msgpack of the endpoint's request struct
CHUNK = "chunk"  # payload = msgpack of one response struct
END = "end"  # the handler finished; no more frames for this stream
ERROR = "error"  # the stream failed; `error` says why; no more frames for this stream
CANCEL = "cancel"  # the client abandons the stream; the server cancels its handler


class Frame(msgspec.Struct, omit_defaults=True, kw_only=True):
    # A plain str (not a Literal) so that a newer peer's new kinds are ignored, not fatal.
    kind: str
    stream_id: int  # chosen by the client, unique per connection
    endpoint: str = ""  # REQUEST only
    payload: bytes = b""
    error: str = ""  # ERROR only: the message
    # ERROR only: what kind of failure (turbine.protocol.errors) and whether another worker may
    # take the request. A peer that sends no code is read as INTERNAL.
    code: str = ""
    retryable: bool = False
    param: str = ""  # ERROR only: the request field an invalid request is about, if one
    # REQUEST only: the caller's W3C trace context (turbine/tracing.py), so the handler's spans join
    # the caller's trace; empty when the caller does not trace (nothing on the wire then).
    traceparent: str = ""
    tracestate: str = ""
    v: int = WIRE_VERSION

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


class Batch(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The NATS request plane's message (turbine/runtime/request_plane_nats.py): the frames one peer
    sent another during one turn of its event loop, as one NATS message on the receiver's subject
    "<its prefix>.in". A batch with no frames is a heartbeat."""

    sender: str  # the sender's subject prefix ("turbine.rpc.<hex>"): where the answers go
    # Counts the sender's batches to this receiver, from 1: a gap means batches were lost on the way.
    seq: int
    frames: list[Frame] = msgspec.field(default_factory=list)
    # Set when this peer lost batches from the receiver: every stream the receiver opened in a batch
    # numbered below this is gone here (and is to be failed there).
    reset_below: int = 0
    # A heartbeat that asks for one back when the receiver has no stream open with the sender (so a
    # lost last batch shows as a gap at once, not after the peer's silence timeout).
    ping: bool = False
    sent_at: float = 0.0  # the sender's clock (Unix seconds): with a cluster key, stale batches are dropped
    v: int = WIRE_VERSION

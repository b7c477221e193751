"""Exceptions raised by the runtime (codec, request plane, discovery)."""

from __future__ import annotations


class DecodeError(ValueError):
    """Bytes could not be decoded into the expected struct; the message names the field."""


class RequestPlaneError(Exception):
    """Base class for request-plane failures seen by a client stream."""


class ConnectFailed(RequestPlaneError):
    """The address could not be reached (refused, unreachable or connect timeout)."""


class PeerDisconnected(RequestPlaneError):
    """The connection dropped while the stream was open; the request may be migrated."""


class RemoteError(RequestPlaneError):
    """The server answered the stream with an error frame."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FrameTooLarge(RequestPlaneError):
    """An outgoing frame exceeds max_frame_bytes (the peer would drop the connection)."""


class DiscoveryError(Exception):
    """The discovery backend could not be started or reached."""

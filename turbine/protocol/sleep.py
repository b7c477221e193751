"""A worker's sleep / wake control: the request-plane payloads of its `sleep`, `wake_up` and
`is_sleeping` endpoints (the status server's /engine/... routes take the same fields as JSON).

Level 1 frees the engine's KV cache; level 2 frees its weights too (they are reloaded on wake).
A sleeping worker is not in discovery, so no frontend routes to it."""

from __future__ import annotations

import msgspec

from turbine.protocol.errors import WIRE_VERSION

SLEEP_LEVELS = (1, 2)


class SleepRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    level: int = 1
    # Seconds in-flight requests may take to finish before they are failed as shutting_down
    # (retryable: a frontend re-issues them elsewhere). None: the worker's --graceful-shutdown-timeout.
    drain_timeout: float | None = None
    v: int = WIRE_VERSION


class WakeUpRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    v: int = WIRE_VERSION


class IsSleepingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    v: int = WIRE_VERSION


class SleepReply(msgspec.Struct, kw_only=True):
    status: str  # "success" | "error"
    message: str = ""
    is_sleeping: bool = False
    level: int = 0  # the sleep level now (0: awake)
    v: int = WIRE_VERSION

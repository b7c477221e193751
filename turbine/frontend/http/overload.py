"""Overload control at the frontend's door: its own bound (--max-inflight-requests) caps the
generation requests it holds at once, whatever the workers say (the workers' refusals are
handled in dispatch: turbine/frontend/dispatch/overload.py)."""

from __future__ import annotations


class InflightLimit:
    """The generation requests the frontend holds at once (from arrival to the last byte of the
    answer); past `limit`, a new one is refused before its body is read."""

    def __init__(self, limit: int):
        self.limit = limit
        self.inflight = 0

    def try_enter(self) -> bool:
        if self.inflight >= self.limit:
            return False
        self.inflight += 1
        return True

    def leave(self) -> None:
        self.inflight -= 1

"""Loud failure when a worker's KV events do not come.

A worker whose model card announces KV events, and to which the router sends a prompt with
full blocks the index does not show on it, must publish BlockStored events once it has
prefilled that prompt. If `deadline_s` after such a request's first token no event at all has
arrived from that worker since the request was routed (the worker may publish before the
first token reaches the router), the router's view of its cache is wrong: the watchdog logs a
warning naming the worker and counts it (kind "none_arrived" if the worker never sent an
event, "stopped" if it did before). One warning per episode: the next arrives only after the
worker's events flowed again and then stopped again. Idle workers are never suspected.

The watchdog knows nothing of sockets: it reads a per-worker count of applied events (the
indexer's) on each `check()`, and has its own clock, so it is tested with a fake one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("turbine.router")

DEFAULT_DEADLINE_S = 10.0
NONE_ARRIVED = "none_arrived"
STOPPED = "stopped"


@dataclass
class _Followed:
    address: str  # where it publishes, for the warning
    seen: int  # its event count at the last check
    ever: bool  # an event arrived from it at some point
    last_event_at: float | None = None
    warned: bool = False  # warned in the current episode (no event since)


class EventWatchdog:
    def __init__(self, model: str, events_of: Callable[[str], int], deadline_s: float = DEFAULT_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_warning: Callable[[str, str], None] | None = None):
        self.model = model
        self.deadline_s = deadline_s
        self._events_of = events_of  # instance id -> events applied from it so far
        self._clock = clock
        self._on_warning = on_warning  # (instance id, kind), e.g. to bump a metric
        self._workers: dict[str, _Followed] = {}
        # request id -> (worker, its event count when the request was routed), until its first token
        self._routed: dict[str, tuple[str, int]] = {}
        # worker -> (when expected events are overdue, its event count when their request was routed)
        self._due: dict[str, deque[tuple[float, int]]] = {}
        self.warnings: Counter[tuple[str, str]] = Counter()

    def follow(self, addresses: dict[str, str]) -> None:
        """The workers whose events the router expects (instance id -> publisher address)."""
        for gone in self._workers.keys() - addresses.keys():
            del self._workers[gone]
            self._due.pop(gone, None)
            self._routed = {r: e for r, e in self._routed.items() if e[0] != gone}
        for instance_id, address in addresses.items():
            if instance_id not in self._workers:
                seen = self._events_of(instance_id)
                self._workers[instance_id] = _Followed(address, seen, ever=seen > 0,
                                                       last_event_at=self._clock() if seen else None)

    def expect(self, request_id: str, instance_id: str) -> None:
        """`request_id` went to `instance_id` with full blocks the index does not show there."""
        if instance_id in self._workers:
            self._routed[request_id] = (instance_id, self._events_of(instance_id))

    def first_token(self, request_id: str) -> None:
        """Prefilled: its blocks are stored by now, their events are on the way."""
        entry = self._routed.pop(request_id, None)
        if entry is not None:
            instance_id, seen_when_routed = entry
            self._due.setdefault(instance_id, deque()).append((self._clock() + self.deadline_s, seen_when_routed))

    def finished(self, request_id: str) -> None:
        # Finished without a first token (failed, cancelled): nothing was prefilled, expect nothing.
        self._routed.pop(request_id, None)

    def check(self) -> list[tuple[str, str]]:
        """Look at every followed worker now; returns the (instance id, kind) warnings it raised."""
        now = self._clock()
        raised = []
        for instance_id, w in self._workers.items():
            seen = self._events_of(instance_id)
            if seen != w.seen:
                w.seen, w.ever, w.last_event_at, w.warned = seen, True, now, False
            due = self._due.get(instance_id)
            if not due:
                continue
            # An event since a request was routed may be its blocks: only the others still wait.
            waiting = [(deadline, count) for deadline, count in due if count == seen]
            overdue = any(deadline <= now for deadline, _ in waiting)
            self._due[instance_id] = deque((d, c) for d, c in waiting if d > now)
            if overdue and not w.warned:
                w.warned = True
                kind = STOPPED if w.ever else NONE_ARRIVED
                self._warn(instance_id, w, kind, now)
                raised.append((instance_id, kind))
        return raised

    def _warn(self, instance_id: str, w: _Followed, kind: str, now: float) -> None:
        self.warnings[(instance_id, kind)] += 1
        if kind == NONE_ARRIVED:
            log.warning("worker %s (model %r): KV events expected but none arrived in %.0fs: its cache is "
                        "invisible to the router. Check that its event publisher %s is reachable from the "
                        "router's host (--host, firewall) and that its engine publishes KV events",
                        instance_id, self.model, self.deadline_s, w.address)
        else:
            log.warning("worker %s (model %r): KV events stopped: none in %.0fs although it stored new "
                        "blocks (last event %.0fs ago), so the router's view of its cache is going stale. "
                        "Check the worker's log and its event publisher %s",
                        instance_id, self.model, self.deadline_s, now - (w.last_event_at or now), w.address)
        if self._on_warning is not None:
            self._on_warning(instance_id, kind)

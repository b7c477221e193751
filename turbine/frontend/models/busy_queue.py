"""Busy thresholds and the frontend's request queue (`--busy-threshold-requests`,
`--busy-threshold-prompt-tokens`, `--busy-queue-size`).

A worker is busy while the requests this frontend has in flight on it (from routing to their last
token) reach `--busy-threshold-requests`; and busy for a request whose prompt would take their prompt
tokens past `--busy-threshold-prompt-tokens` (a worker with nothing in flight takes any prompt). A new request goes only to a worker that is not busy; when every
worker of its model is busy it waits here, first come first served, and goes to the first worker
that drops below the thresholds (a request there finished, or a worker joined: a planner's scale-up
drains the queue). The wait counts in its TTFT, like any other. More than `--busy-queue-size`
waiting: 503 'overloaded' with Retry-After.

Why: an aggregated engine computes each new prompt between the decode steps of the requests it
already serves, so every prompt it admits stretches their inter-token gaps. A request's mean ITL
grows with the prompt tokens admitted during its life, which (Little's law) is about what the
engine holds at once: bounding the prompt tokens (or requests) in flight per worker bounds the
stall its decodes see, and the excess waits for its first token instead, where the TTFT target
often has slack (docs/benchmarks/planner.md, SLA planner, H3). A request's continuation after a worker
failure (migration) does not wait: it already holds its place. The counts are this frontend's own
(as Dynamo's router-local queue); with several frontends each holds its own share.

NVIDIA Dynamo has the same two parts: busy thresholds per worker and a router queue that holds
requests while every worker is over its threshold (FCFS by default).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from turbine.config import check, flag
from turbine.protocol.discovery import InstanceRecord

DEFAULT_QUEUE_SIZE = 1024


@dataclass(frozen=True)
class BusyConfig:
    # None: that threshold is off. With both off there is no queue (and --busy-queue-size is refused).
    requests: int | None = flag("--busy-threshold-requests", default=None)
    prompt_tokens: int | None = flag("--busy-threshold-prompt-tokens", default=None)
    queue_size: int | None = flag("--busy-queue-size", default=None)  # None: DEFAULT_QUEUE_SIZE when on

    def __post_init__(self):
        check(self, self.requests is None or self.requests >= 1, "requests", "must be >= 1")
        check(self, self.prompt_tokens is None or self.prompt_tokens >= 1, "prompt_tokens", "must be >= 1")
        check(self, self.queue_size is None or self.queue_size >= 0, "queue_size", "must be >= 0")
        check(self, self.queue_size is None or self.enabled, "queue_size",
              "has no effect without --busy-threshold-requests or --busy-threshold-prompt-tokens")

    @property
    def enabled(self) -> bool:
        return self.requests is not None or self.prompt_tokens is not None

    @property
    def max_waiting(self) -> int:
        return DEFAULT_QUEUE_SIZE if self.queue_size is None else self.queue_size


class QueueFull(Exception):
    pass


class BusyQueue:
    """One model's in-flight counts per worker and its FIFO of requests waiting for a worker that
    is not busy. Single event loop: no locks."""

    def __init__(self, cfg: BusyConfig):
        self.cfg = cfg
        self._requests: dict[str, int] = {}  # instance id -> requests in flight there
        self._tokens: dict[str, int] = {}  # instance id -> their prompt tokens
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._woken = 0  # waiters woken that have not looked yet (newcomers do not pass them)
        # The live instances of each model this queue serves (the base model and its adapters),
        # kept current by the frontend's model table: a waiter sees workers that joined after it came.
        self.instances: dict[str, list[InstanceRecord]] = {}

    def busy(self, instance_id: str, prompt_tokens: int = 0) -> bool:
        """Whether the worker may not take a request of `prompt_tokens` now (a worker with nothing
        in flight takes any: a prompt over the threshold is not refused for good)."""
        c, held = self.cfg, self._tokens.get(instance_id, 0)
        return ((c.requests is not None and self._requests.get(instance_id, 0) >= c.requests)
                or (c.prompt_tokens is not None and held > 0 and held + prompt_tokens > c.prompt_tokens))

    def free(self, model: str, prompt_tokens: int = 0) -> list[InstanceRecord]:
        return [i for i in self.instances.get(model, ()) if not self.busy(i.instance_id, prompt_tokens)]

    def set_instances(self, instances: dict[str, list[InstanceRecord]]) -> None:
        self.instances = instances
        self.wake()  # a worker that joined is free

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def admit(self, model: str, prompt_tokens: int = 0) -> list[InstanceRecord]:
        """The live workers of `model` that a request of `prompt_tokens` may go to (those not busy for
        it), after waiting its turn while none is free; [] when the model has no live worker (nothing
        to wait for). Raises QueueFull when the queue is at its bound."""
        free = self.free(model, prompt_tokens)
        if not self.instances.get(model) or (free and not self._waiting and not self._woken):
            return free
        if len(self._waiting) >= self.cfg.max_waiting:
            raise QueueFull(f"{len(self._waiting)} requests wait for a worker below the busy thresholds")
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        while True:
            try:
                await fut
            except BaseException:
                self._leave(fut)
                raise
            self._woken -= 1
            # At the head (woken in order): go if a worker is free, else wait at the head again.
            free = self.free(model, prompt_tokens)
            if free or not self.instances.get(model):
                self.wake()  # the next in line may find a worker free too
                return free
            fut = asyncio.get_running_loop().create_future()
            self._waiting.appendleft(fut)

    def _leave(self, fut: asyncio.Future) -> None:
        """A waiter leaves (its client went away)."""
        if fut.done() and not fut.cancelled():
            self._woken -= 1
            self.wake()  # it had been woken: pass the turn on
        else:
            try:
                self._waiting.remove(fut)
            except ValueError:
                pass

    def wake(self) -> None:
        """Let the head of the queue look again (a request ended, or the workers changed)."""
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self._woken += 1
                return

    def add(self, instance_id: str, prompt_tokens: int) -> None:
        self._requests[instance_id] = self._requests.get(instance_id, 0) + 1
        self._tokens[instance_id] = self._tokens.get(instance_id, 0) + prompt_tokens

    def remove(self, instance_id: str, prompt_tokens: int) -> None:
        n = self._requests.get(instance_id, 0) - 1
        if n <= 0:
            self._requests.pop(instance_id, None)
            self._tokens.pop(instance_id, None)
        else:
            self._requests[instance_id] = n
            self._tokens[instance_id] = max(0, self._tokens.get(instance_id, 0) - prompt_tokens)
        if self._waiting:
            self.wake()

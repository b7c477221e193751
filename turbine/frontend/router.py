"""Picks a worker instance for a request among a model's live instances."""

from __future__ import annotations

import itertools
import random

from turbine.protocol.discovery import InstanceRecord

ROUTER_MODES = ("round-robin", "random")


class Router:
    def select(self, instances: list[InstanceRecord]) -> InstanceRecord:
        raise NotImplementedError


class RoundRobinRouter(Router):
    def __init__(self):
        self._counter = itertools.count()

    def select(self, instances: list[InstanceRecord]) -> InstanceRecord:
        return instances[next(self._counter) % len(instances)]


class RandomRouter(Router):
    def select(self, instances: list[InstanceRecord]) -> InstanceRecord:
        return random.choice(instances)


def make_router(mode: str) -> Router:
    if mode == "round-robin":
        return RoundRobinRouter()
    if mode == "random":
        return RandomRouter()
    raise ValueError(f"--router-mode {mode!r}: choose from {', '.join(ROUTER_MODES)}")

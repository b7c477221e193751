"""Choosing a worker for a request from its cached overlap and its load.

cost = overlap_weight × prefill blocks still to compute on that worker (its queued prefill
plus this request's uncached part) + decode blocks (its blocks in use plus this request's
new ones). Lowest wins; ties go to the less loaded worker; a temperature > 0 samples.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from turbine.router.indexer import WorkerKey


@dataclass
class WorkerLoad:
    active_blocks: int = 0  # KV blocks in use by running requests
    prefill_tokens: int = 0  # prompt tokens queued or being prefilled


class LoadTracker:
    """Counts what the router itself just sent to each worker until those requests finish,
    so that a burst of requests sees the queues it is building and does not herd."""

    def __init__(self):
        self._requests: dict[str, tuple[WorkerKey, int, int]] = {}  # id -> worker, prefill, blocks
        self._loads: dict[WorkerKey, WorkerLoad] = {}

    def load(self, worker: WorkerKey) -> WorkerLoad:
        return self._loads.get(worker) or WorkerLoad()

    def add(self, request_id: str, worker: WorkerKey, prefill_tokens: int, blocks: int) -> None:
        load = self._loads.setdefault(worker, WorkerLoad())
        load.prefill_tokens += prefill_tokens
        load.active_blocks += blocks
        self._requests[request_id] = (worker, prefill_tokens, blocks)

    def prefill_done(self, request_id: str) -> None:
        """The first token arrived: the prompt no longer waits for prefill."""
        entry = self._requests.get(request_id)
        if entry and entry[1]:
            worker, prefill, blocks = entry
            self._loads[worker].prefill_tokens -= prefill
            self._requests[request_id] = (worker, 0, blocks)

    def free(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry:
            worker, prefill, blocks = entry
            load = self._loads[worker]
            load.prefill_tokens -= prefill
            load.active_blocks -= blocks

    def forget_worker(self, worker: WorkerKey) -> None:
        self._loads.pop(worker, None)
        self._requests = {r: e for r, e in self._requests.items() if e[0] != worker}


def new_blocks(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Blocks a request allocates beyond the cached prefix it shares: room for its prompt and
    its first output token (so even a fully cached prompt costs a block, and identical
    requests are not free to pile onto one worker)."""
    return math.ceil((prompt_tokens + 1) / block_size) - overlap_blocks


def worker_costs(overlaps: dict[WorkerKey, int], loads: dict[WorkerKey, WorkerLoad], prompt_tokens: int,
                 block_size: int, overlap_weight: float) -> dict[WorkerKey, float]:
    costs = {}
    for worker, load in loads.items():
        overlap = overlaps.get(worker, 0)
        prefill_blocks = (load.prefill_tokens + prompt_tokens - overlap * block_size) / block_size
        decode_blocks = load.active_blocks + new_blocks(prompt_tokens, overlap, block_size)
        costs[worker] = overlap_weight * prefill_blocks + decode_blocks
    return costs


def choose_worker(costs: dict[WorkerKey, float], loads: dict[WorkerKey, WorkerLoad], temperature: float = 0.0,
                  rng: random.Random | None = None) -> WorkerKey:
    if not costs:
        raise ValueError("no candidate workers")
    rng = rng or random
    if temperature > 0:
        lo, hi = min(costs.values()), max(costs.values())
        span = (hi - lo) or 1.0
        workers = list(costs)
        weights = [math.exp(-((costs[w] - lo) / span) / temperature) for w in workers]
        return rng.choices(workers, weights=weights)[0]
    best = min(costs.values())
    tied = [w for w, c in costs.items() if c == best]
    if len(tied) > 1:
        least = min(loads[w].active_blocks + loads[w].prefill_tokens for w in tied)
        tied = [w for w in tied if loads[w].active_blocks + loads[w].prefill_tokens == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)

"""Choosing a worker for a request from its cached overlap and its load (the worker's own
reports merged with what the router itself just sent it).

cost = overlap_weight × prefill blocks still to compute on that worker (its queued prefill
plus this request's uncached part) + decode blocks (its blocks in use and those of the requests
queued there, plus this request's new ones). Lowest wins; ties go to the less loaded worker; a
temperature > 0 samples.

A worker's queue counts from two sides: the requests this router sent it that have no first
token yet (their uncached prompt tokens and their new blocks), and the requests the worker
itself reports waiting beyond those (another router's, or a frontend's that restarted), each at
the size of the request being routed. Counting the queued requests' cached prefix too (their
whole context) was measured and left out: on the Mooncake trace at 200 % of capacity it spread
conversations away from their caches, lowering the hit rate and the fleet's throughput
(docs/benchmarks/routing.md, KV routing under overload).

LoRA: a request for an adapter that a worker does not hold in its active slots (as its last load
report lists them, plus the adapters of the requests this router sent it that have not finished)
costs that worker `lora_swap_weight` blocks more: the engine must swap the adapter in before the
prefill. Twice that where every slot serves unfinished requests of other adapters that this router
sent there: the request also waits for one of those adapters to drain (vLLM batches at most
max_loras adapters). Without that second level, the few requests of rare adapters landed on workers
whose slots the popular adapters kept busy and waited there for seconds (the TTFT tail; benchmarks/
docs/benchmarks/routing.md, "Adapter-aware routing").

KV tiers (`--connector kvbm`): a prompt block that a worker's engine lacks but one of its offload
tiers holds (or the shared tier it sees) is loaded, not computed: it costs TIER_WEIGHTS[tier] of a
prefill block (0 would be an engine hit, 1 a recomputation). The weights are measured on the real
CPU engine (benchmarks/kv_tiers/kvbm_tier_weights.py, docs/benchmarks/kv_tiers.md "KV tier weights"), not guessed.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.indexer import WorkerKey


@dataclass
class WorkerLoad:
    active_blocks: int = 0  # KV blocks in use by running requests
    prefill_tokens: int = 0  # prompt tokens queued or being prefilled
    # Requests the worker reports waiting beyond those this router sent it without a first token yet.
    other_waiting: int = 0


@dataclass
class _Sent:
    """A request this router placed, and how much of it the router still counts itself."""

    worker: WorkerKey
    prefill_tokens: int  # 0 once its first token came
    blocks: int
    handed_over: bool = False  # the worker's own reports now include its blocks
    lora_name: str | None = None


class LoadTracker:
    """A worker's load = what it last reported about itself (LoadMetrics) + what this router
    sent it that those reports cannot include yet.

    A request counts on the router's side, with its blocks and its prefill tokens, from the
    moment it is routed: a burst of requests then sees the queues it is building and does not
    herd onto one worker before any worker report could show them. Its prefill tokens stop
    counting at its first token (the prompt is computed). Its blocks stop counting at the
    first worker report that arrives after its first token: the first token proves that the
    worker admitted it, so that report's blocks include it, and counting both would count it
    twice. A worker that never reports keeps its requests counted by the router until they
    finish. Between the worker admitting a request and that hand-over, its blocks may count
    twice: the router errs towards too much load, never too little.
    """

    def __init__(self):
        self._sent: dict[str, _Sent] = {}
        self._own: dict[WorkerKey, WorkerLoad] = {}  # router-side counts, per worker
        self._reports: dict[WorkerKey, LoadMetrics] = {}  # each worker's latest report
        self._awaiting_report: dict[WorkerKey, set[str]] = {}  # first token seen, not handed over
        self._waiting: dict[WorkerKey, int] = {}  # requests sent, no first token yet
        self._loras: dict[WorkerKey, Counter[str]] = {}  # adapters of the unfinished requests sent there

    def load(self, worker: WorkerKey) -> WorkerLoad:
        own = self._own.get(worker) or WorkerLoad()
        report = self._reports.get(worker)
        if report is None:
            return WorkerLoad(own.active_blocks, own.prefill_tokens)
        other = max(0, report.num_waiting - self._waiting.get(worker, 0))
        return WorkerLoad(report.kv_active_blocks + own.active_blocks, own.prefill_tokens, other)

    def pending(self, worker: WorkerKey) -> WorkerLoad:
        """What the router counts itself for `worker` (not covered by its reports)."""
        own = self._own.get(worker)
        return WorkerLoad(own.active_blocks, own.prefill_tokens) if own else WorkerLoad()

    def reported(self, worker: WorkerKey) -> LoadMetrics | None:
        return self._reports.get(worker)

    def reporting_workers(self) -> list[WorkerKey]:
        return list(self._reports)

    def lora_swaps(self, worker: WorkerKey, lora_name: str) -> int:
        """What a request of this adapter costs the worker, in adapter swaps. 0: the adapter is (or is
        about to be) in one of its active slots: its last report lists it, or a request of it that this
        router sent there has not finished (the worker swapped it in for that request, and a request of
        the same adapter joins it). 1: it is not. 2: besides, every slot serves unfinished requests this
        router sent there of other adapters, so the request also waits for one of them to drain."""
        report = self._reports.get(worker)
        mine = self._loras.get(worker, {})
        if mine.get(lora_name):
            return 0
        slots = report.max_loras if report is not None else 0
        busy = bool(slots) and len(mine) >= slots
        if report is not None and lora_name in report.active_loras and not busy:
            return 0  # (a slot the report lists can be taken by then: not while every slot is busy)
        return 2 if busy else 1

    def lora_active(self, worker: WorkerKey, lora_name: str) -> bool:
        return self.lora_swaps(worker, lora_name) == 0

    def add(self, request_id: str, worker: WorkerKey, prefill_tokens: int, blocks: int,
            lora_name: str | None = None) -> None:
        self.free(request_id)  # routed again (its first worker was unreachable): it counts only once
        load = self._own.setdefault(worker, WorkerLoad())
        load.prefill_tokens += prefill_tokens
        load.active_blocks += blocks
        self._waiting[worker] = self._waiting.get(worker, 0) + 1
        self._sent[request_id] = _Sent(worker, prefill_tokens, blocks, lora_name=lora_name)
        if lora_name:
            self._loras.setdefault(worker, Counter())[lora_name] += 1

    def _started(self, sent: _Sent) -> None:
        """The request waits no more (its first token came, or it ended before)."""
        load = self._own[sent.worker]
        load.prefill_tokens -= sent.prefill_tokens
        sent.prefill_tokens = 0
        self._waiting[sent.worker] -= 1

    def prefill_done(self, request_id: str) -> None:
        """The first token arrived: the prompt no longer waits for prefill, and the worker's
        next report will include the request."""
        sent = self._sent.get(request_id)
        if sent is None or sent.handed_over or request_id in self._awaiting_report.get(sent.worker, ()):
            return
        self._started(sent)
        self._awaiting_report.setdefault(sent.worker, set()).add(request_id)

    def report(self, worker: WorkerKey, metrics: LoadMetrics) -> None:
        """A worker's own numbers arrived: they now cover every request whose first token came before."""
        self._reports[worker] = metrics
        for request_id in self._awaiting_report.pop(worker, ()):
            sent = self._sent[request_id]
            self._own[worker].active_blocks -= sent.blocks
            sent.handed_over = True

    def free(self, request_id: str) -> None:
        sent = self._sent.pop(request_id, None)
        if sent is None:
            return
        if sent.lora_name:
            loras = self._loras[sent.worker]
            loras[sent.lora_name] -= 1
            if not loras[sent.lora_name]:
                del loras[sent.lora_name]
        if sent.handed_over:
            return  # not counted here any more: the worker's next report drops its blocks
        awaiting = self._awaiting_report.get(sent.worker)
        if awaiting is not None and request_id in awaiting:
            awaiting.discard(request_id)
        else:
            self._started(sent)
        self._own[sent.worker].active_blocks -= sent.blocks

    def forget_instance(self, instance_id: str) -> None:
        """Every data-parallel rank of an instance (it left discovery)."""
        for table in (self._own, self._reports, self._awaiting_report, self._waiting, self._loras):
            for w in [w for w in table if w.instance_id == instance_id]:
                del table[w]
        self._sent = {r: s for r, s in self._sent.items() if s.worker.instance_id != instance_id}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sent


def new_blocks(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Blocks a request allocates beyond the cached prefix it shares: room for its prompt and
    its first output token (so even a fully cached prompt costs a block, and identical
    requests are not free to pile onto one worker)."""
    return math.ceil((prompt_tokens + 1) / block_size) - overlap_blocks


# What loading one block from a tier costs, as a share of computing it (the engine's own cache: 0).
# Measured on the real vLLM CPU engine (benchmarks/kv_tiers/kvbm_tier_weights.py, docs/benchmarks/kv_tiers.md "KV tier weights",
# 2026-11-27: SmolLM2-135M float32, 128-token blocks of 5.9 MB; a block computed in 253 ms, loaded from
# host memory in 2.8 ms, from the disk tier in 3.6 ms, its files in the page cache): host 0.011, disk
# 0.014. The shared tier is the disk tier's file code on a directory others write too: the disk weight
# until measured on a network filesystem.
TIER_WEIGHTS = {"host": 0.011, "disk": 0.014, "shared": 0.014}


def tier_credit(tiers: list[str], weights: dict[str, float] | None = None) -> float:
    """The prefill blocks a worker saves by loading these blocks from its tiers instead of computing them."""
    weights = TIER_WEIGHTS if weights is None else weights
    return sum(1.0 - weights.get(t, 1.0) for t in tiers)


def worker_costs(overlaps: dict[WorkerKey, int], loads: dict[WorkerKey, WorkerLoad], prompt_tokens: int,
                 block_size: int, overlap_weight: float, lora_swaps: dict[WorkerKey, int] | None = None,
                 lora_swap_weight: float = 0.0, tier_credits: dict[WorkerKey, float] | None = None
                 ) -> dict[WorkerKey, float]:
    """`lora_swaps`: per worker, what the request's adapter costs it in swaps (LoadTracker.lora_swaps);
    each costs `lora_swap_weight` blocks. `tier_credits`: per worker, the prefill blocks its tiers save
    beyond its engine's overlap (tier_credit)."""
    lora_swaps = lora_swaps or {}
    tier_credits = tier_credits or {}
    costs = {}
    context_blocks = new_blocks(prompt_tokens, 0, block_size)  # the size of another router's queued request
    for worker, load in loads.items():
        overlap = overlaps.get(worker, 0)
        prefill_blocks = ((load.prefill_tokens + prompt_tokens - overlap * block_size) / block_size
                          - tier_credits.get(worker, 0.0))
        decode_blocks = (load.active_blocks + load.other_waiting * context_blocks
                         + new_blocks(prompt_tokens, overlap, block_size))
        costs[worker] = overlap_weight * prefill_blocks + decode_blocks + lora_swap_weight * lora_swaps.get(worker, 0)
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

"""The KV-aware routing decision: hash the prompt's blocks, ask the index which workers hold
how much of that prefix, add each worker's load, and pick the cheapest."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from turbine.router.approx import ApproxKvIndexer
from turbine.router.cost import LoadTracker, choose_worker, new_blocks, worker_costs
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey


# Prefill blocks weigh 4 decode blocks: on the 16-worker fleet benchmark (benchmarks/RESULTS.md,
# 2026-11-26) weight 4 beat 1 on TTFT p50/p99 and cache hits for both workloads; computing a block
# of prompt costs the engine far more than holding one more block while decoding.
DEFAULT_OVERLAP_WEIGHT = 4.0


@dataclass(frozen=True)
class KvRouterConfig:
    block_size: int
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    temperature: float = 0.0
    use_kv_events: bool = True  # False: approximate mode (index learned from our own decisions)
    approx_ttl_s: float = 120.0


@dataclass
class Decision:
    worker: WorkerKey
    overlap_blocks: int
    costs: dict[WorkerKey, float]
    seconds: float  # decision latency, for the router's metrics
    overlap_ratio: float  # cached share of the prompt's full blocks on the chosen worker
    prompt_blocks: int = 0  # full blocks in the prompt


class KvRouter:
    def __init__(self, cfg: KvRouterConfig, rng: random.Random | None = None):
        self.cfg = cfg
        self.index: KvIndexer | ApproxKvIndexer = (KvIndexer(cfg.block_size) if cfg.use_kv_events
                                                   else ApproxKvIndexer(cfg.approx_ttl_s))
        self.loads = LoadTracker()
        self._rng = rng or random.Random()

    def decide(self, request_id: str, token_ids: list[int], workers: list[WorkerKey],
               lora_name: str | None = None, track: bool = True) -> Decision:
        """`track`: count the request as load on the chosen worker until `finished` (False:
        a query that changes nothing)."""
        started = time.perf_counter()
        hashes = block_hashes(token_ids, self.cfg.block_size, lora_name=lora_name)
        overlaps = self.index.find_matches(hashes)
        loads = {w: self.loads.load(w) for w in workers}
        costs = worker_costs(overlaps, loads, len(token_ids), self.cfg.block_size, self.cfg.overlap_weight)
        worker = choose_worker(costs, loads, self.cfg.temperature, self._rng)
        overlap = overlaps.get(worker, 0)
        if track:
            self.loads.add(request_id, worker, prefill_tokens=len(token_ids) - overlap * self.cfg.block_size,
                           blocks=new_blocks(len(token_ids), overlap, self.cfg.block_size))
            if isinstance(self.index, ApproxKvIndexer):
                self.index.record(worker, hashes)
        return Decision(worker, overlap, costs, time.perf_counter() - started,
                        overlap / len(hashes) if hashes else 0.0, len(hashes))

    def first_token(self, request_id: str) -> None:
        self.loads.prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        self.loads.free(request_id)

    def worker_left(self, worker: WorkerKey) -> None:
        self.index.remove_worker(worker)
        self.loads.forget_worker(worker)

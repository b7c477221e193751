"""The KV-aware routing decision: hash the prompt's blocks, ask the index which workers hold
how much of that prefix, add each worker's load, and pick the cheapest."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from turbine.router.approx import ApproxKvIndexer
from turbine.router.config import KvRouterConfig
from turbine.router.cost import LoadTracker, choose_worker, new_blocks, tier_credit, worker_costs
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey


@dataclass
class Decision:
    worker: WorkerKey
    overlap_blocks: int
    costs: dict[WorkerKey, float]
    seconds: float  # decision latency, for the router's metrics
    overlap_ratio: float  # cached share of the prompt's full blocks on the chosen worker
    prompt_blocks: int = 0  # full blocks in the prompt
    lora_active: bool | None = None  # the chosen worker had the request's adapter active (None: no adapter)


class KvRouter:
    """`block_size`: the model's (from its card); workers of another block size are not indexed."""

    def __init__(self, cfg: KvRouterConfig, block_size: int, rng: random.Random | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.cfg = cfg
        self.block_size = block_size
        self.index: KvIndexer | ApproxKvIndexer = (KvIndexer(block_size, cfg.use_kv_tiers) if cfg.use_kv_events
                                                   else ApproxKvIndexer(cfg.approx_ttl_s))
        self.loads = LoadTracker()
        self._rng = rng or random.Random()

    def decide(self, request_id: str, token_ids: list[int], workers: list[WorkerKey],
               lora_name: str | None = None, track: bool = True, media_keys: list[int] | None = None) -> Decision:
        """`workers`: every candidate, each data-parallel rank its own. `lora_name` salts the block
        hashes: the same tokens under another adapter are another KV cache. `track`: count the
        request as load on the chosen worker until `finished` (False: a query that changes nothing)."""
        started = time.perf_counter()
        bs = self.block_size
        hashes = block_hashes(token_ids, bs, lora_name=lora_name, media_keys=media_keys)
        overlaps = self.index.find_matches(hashes)
        loads = {w: self.loads.load(w) for w in workers}
        # Blocks past a worker's engine match that its offload tiers (or its shared tier) hold: loaded, not computed.
        credits = ({w: tier_credit(t) for w, t in self.index.tier_matches(hashes, workers, overlaps).items()}
                   if isinstance(self.index, KvIndexer) else {})
        # An adapter's request prefers a worker that has the adapter active: elsewhere it waits for a swap.
        swaps = {w: self.loads.lora_swaps(w, lora_name) for w in workers} if lora_name else {}
        costs = worker_costs(overlaps, loads, len(token_ids), bs, self.cfg.overlap_weight, swaps,
                             self.cfg.lora_swap_weight, credits)
        worker = choose_worker(costs, loads, self.cfg.temperature, self._rng)
        overlap = overlaps.get(worker, 0)
        if track:
            saved = round(credits.get(worker, 0.0) * bs)
            self.loads.add(request_id, worker, prefill_tokens=max(0, len(token_ids) - overlap * bs - saved),
                           blocks=new_blocks(len(token_ids), overlap, bs), lora_name=lora_name)
            if isinstance(self.index, ApproxKvIndexer):
                self.index.record(worker, hashes)
        return Decision(worker, overlap, costs, time.perf_counter() - started,
                        overlap / len(hashes) if hashes else 0.0, len(hashes),
                        (swaps[worker] == 0) if lora_name else None)

    def first_token(self, request_id: str) -> None:
        self.loads.prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        self.loads.free(request_id)

    def instance_left(self, instance_id: str) -> None:
        """An instance left: every rank of it goes from the index and the loads."""
        self.index.remove_instance(instance_id)
        self.loads.forget_instance(instance_id)

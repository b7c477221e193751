#!/usr/bin/env python3
r"""KV indexer micro-benchmark (issue #4): block events ingested per second on one core, and
the latency of the KV routing decision for long prompts against a large index.

1. Ingest.  Workers' KV events are generated up front by the mocker's own simulated block pool
   (`turbine.mocker.kv_cache.BlockPool`, vLLM's prefix-caching rules with LRU eviction), fed by
   a multi-turn chat workload over --ingest-workers workers: a few shared system prompts,
   growing conversation histories, each turn's prompt stored in one BlockStored (its new blocks,
   chained to the cached parent), then its answer one block at a time as decode fills blocks;
   allocations that find no empty block evict least-recently-used blocks (BlockRemoved).  The
   pools are first filled (warm-up, not timed) so the measured stream is the steady state: about
   as many blocks removed as stored.  Timed: `KvIndexer.apply(worker, event)` over the
   stream (objects already decoded), and separately msgspec-decoding each KvEventBatch from its
   wire bytes + apply (what `KvEventsConsumer` does per batch, minus the zmq socket).  Since wire
   version 2 a BlockStored carries its token ids packed (little-endian u32 bytes): decoding makes
   one bytes object per event, and the index hashes those bytes directly.
   **One block event = one block stored or one block removed**: a BlockStored of k blocks is k
   block events; a BlockRemoved of k hashes is k block events.

2. Decision.  `KvRouter.decide` (turbine/router/kv_router.py: hash the prompt's blocks, query the
   index, compute the costs of every worker, choose, record the load) with --decision-workers
   workers and an index of --indexed-blocks (worker, block) entries, i.e. the sum over workers of
   `KvIndexer.blocks_of` (filled through `apply`, like the events would), for prompts of
   --prompt-tokens tokens.  Query scenarios:
     miss     unseen tokens: nothing matches (hashing + one lookup + costs);
     typical  the continuation of an indexed conversation: its system prompt is held by every
              worker, its history by 1-2 workers, the last --new-tokens tokens are new;
     worst    the whole prompt is held by every worker (each block intersects 64 holder sets).
   Each decision is followed by `finished` (untimed), so loads stay bounded.  GC stays on, as in
   the frontend.  The breakdown (hashing alone, find_matches alone) is measured on the same prompts.

Single thread, one process: "one core".  Numbers are per wall second and per CPU second of this
process (CPU time is less disturbed by other processes on a shared machine).

  .venv/bin/python -m benchmarks.routing.indexer_micro --repeats 5 --compare-ref 8559aaa \
      --out benchmarks/results/routing/indexer_micro-$(date +%F).json
"""

from __future__ import annotations

import argparse
import datetime as _dt
from array import array
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lib.args import parse_int_list
from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import log
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.results import git_commit
from benchmarks.lib.stats import pct


import msgspec

from turbine.mocker.kv_cache import BlockPool
from turbine.protocol.kv_events import BlockRemoved, BlockStored, KvEventBatch
from turbine.router.config import KvRouterConfig
from turbine.router.indexer import WorkerKey

VOCAB = 49152  # SmolLM2's vocabulary size: token ids are drawn below it
_INTS = list(range(VOCAB))  # token lists reference these shared int objects (memory)


def block_events(event) -> int:
    return len(event.block_hashes) if isinstance(event, (BlockStored, BlockRemoved)) else 0


# --------------------------------------------------------------------------- implementations
class Impl:
    """One implementation of the router's hashing + index + decision: this tree's, or a peer's
    loaded from a git revision (--compare-ref) and measured in the same run."""

    def __init__(self, name: str, hashing, indexer, kv_router):
        self.name = name
        self.block_hashes = hashing.block_hashes
        self.KvIndexer = indexer.KvIndexer
        self.KvRouter = kv_router.KvRouter


def current_impl() -> Impl:
    import turbine.router.hashing as h
    import turbine.router.indexer as i
    import turbine.router.kv_router as k
    return Impl(f"this tree ({git_commit()})", h, i, k)


def peer_impl(ref: str) -> Impl:
    """turbine/router/{hashing,indexer}.py as of `ref`, as private modules, with this tree's
    kv_router.py wired to them (cost.py, approx.py and the event structs are this tree's too), so
    the two implementations differ only in hashing and indexing."""
    import types
    mods = {}
    for name in ("hashing", "indexer", "kv_router"):
        path = f"turbine/router/{name}.py"
        if name == "kv_router":
            src = (REPO_ROOT / path).read_text()
        else:
            src = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True,
                                 check=True).stdout
        for dep in ("hashing", "indexer"):
            src = src.replace(f"from turbine.router.{dep} import", f"from _peer_router_{dep} import")
        mod = types.ModuleType(f"_peer_router_{name}")
        mod.__file__ = f"{ref}:{path}"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        mods[name] = mod
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO_ROOT, capture_output=True, text=True
                         ).stdout.strip()
    return Impl(f"hashing+indexer of {sha or ref}", mods["hashing"], mods["indexer"], mods["kv_router"])


class GcWatch:
    """Time spent in garbage collections while active, per generation."""

    def __init__(self):
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t = 0.0
        self.active = False

    def __call__(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._t) * 1e3)

    def summary(self) -> dict:
        return {f"gen{g}": {"count": len(p), "max_ms": max(p, default=0.0), "total_ms": sum(p)}
                for g, p in self.pauses.items()}


# --------------------------------------------------------------------------- ingest workload
class Corpus:
    """Random token ids; prompts are slices of it.  As a list, slices share its int objects (the
    ingest stream keeps millions of tokens in its events); as an array, the corpus is one object
    the garbage collector does not scan (the decision benchmark measures collection pauses)."""

    def __init__(self, n: int, rng: random.Random, as_array: bool = False):
        values = [rng.randrange(1000, VOCAB) for _ in range(n)]
        self.tokens = array("I", values) if as_array else [_INTS[v] for v in values]
        self.rng = rng

    def offset(self, n: int) -> int:
        return self.rng.randrange(0, len(self.tokens) - n)

    def at(self, off: int, n: int) -> list[int]:
        t = self.tokens[off:off + n]
        return t.tolist() if isinstance(t, array) else t

    def take(self, n: int) -> list[int]:
        return self.at(self.offset(n), n)


def mocker_hashes(tokens: list[int], bs: int, from_block: int = 0, prev: list[int] | None = None) -> list[int]:
    from turbine.mocker.kv_cache import block_hash
    out = list(prev or [])
    parent = out[-1] if out else None
    for i in range(len(out), len(tokens) // bs):
        parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def ingest_stream(a, bs: int) -> tuple[list, list, dict]:
    """(warm-up events, measured events, stats): lists of (WorkerKey, event) in arrival order."""
    rng = random.Random(a.seed)
    corpus = Corpus(1 << 20, rng)
    workers = [WorkerKey(f"w{i:02d}") for i in range(a.ingest_workers)]
    cap_blocks = max(64, a.ingest_cache_tokens // bs)
    events: list = []
    current: list = []  # the worker whose pool is emitting (set before each pool call)
    produced = [0]  # block events so far

    def on_event(e):
        events.append((current[0], e))
        produced[0] += block_events(e)
    pools = {w: BlockPool(cap_blocks, bs, on_event=on_event) for w in workers}
    systems = [corpus.take(a.system_tokens) for _ in range(a.system_prompts)]

    class Conv:
        def __init__(self):
            self.tokens = list(systems[rng.randrange(len(systems))])
            self.hashes: list[int] = []
            self.home = rng.choice(workers)
    convs = [Conv() for _ in range(a.conversations)]
    warm_target = a.ingest_workers * cap_blocks * 2  # fill every pool, then some eviction
    total_target = None
    n_warm = None
    while True:
        if n_warm is None and produced[0] >= warm_target:
            n_warm, total_target = len(events), produced[0] + a.ingest_events
        if total_target is not None and produced[0] >= total_target:
            break
        ci = rng.randrange(len(convs))
        c = convs[ci]
        c.tokens += corpus.take(rng.randint(a.user_tokens // 2, a.user_tokens * 3 // 2))
        answer = corpus.take(rng.randint(a.answer_tokens // 2, a.answer_tokens * 3 // 2))
        if len(c.tokens) + len(answer) > a.max_context:
            convs[ci] = Conv()
            continue
        # Mostly the conversation's usual worker (what a KV router aims for), sometimes another.
        w = c.home if rng.random() < 0.7 else rng.choice(workers)
        pool = pools[w]
        current[:] = [w]
        c.hashes = mocker_hashes(c.tokens, bs, prev=c.hashes[:len(c.tokens) // bs])
        hits = pool.lookup(c.hashes[:(len(c.tokens) - 1) // bs])
        pool.acquire(hits)
        n_prompt_blocks = -(-len(c.tokens) // bs)
        blocks = list(hits) + pool.allocate(n_prompt_blocks - len(hits))
        pool.cache_full_blocks(blocks, c.hashes, len(hits), len(c.tokens) // bs, c.tokens)
        # Decode: the answer fills blocks one by one; each full one is cached (1-block events).
        seq = list(c.tokens)
        done = len(c.tokens) // bs
        for t in answer:
            seq.append(t)
            if len(seq) > len(blocks) * bs:
                blocks += pool.allocate(1)
            if len(seq) % bs == 0:
                hashes = mocker_hashes(seq, bs, prev=c.hashes)
                pool.cache_full_blocks(blocks, hashes, done, len(seq) // bs, seq)
                c.hashes = hashes
                done = len(seq) // bs
        pool.free(reversed(blocks))
        c.tokens = seq
        c.hashes = c.hashes[:len(seq) // bs]
    warm, meas = events[:n_warm], events[n_warm:]
    stats = {"block_size": bs, "workers": a.ingest_workers, "cache_blocks_per_worker": cap_blocks,
             "warmup_block_events": sum(block_events(e) for _, e in warm),
             "block_events": sum(block_events(e) for _, e in meas),
             "stored_blocks": sum(len(e.block_hashes) for _, e in meas if isinstance(e, BlockStored)),
             "removed_blocks": sum(len(e.block_hashes) for _, e in meas if isinstance(e, BlockRemoved)),
             "event_messages": len(meas),
             "stored_messages": sum(1 for _, e in meas if isinstance(e, BlockStored)),
             "removed_messages": sum(1 for _, e in meas if isinstance(e, BlockRemoved))}
    stats["blocks_per_stored_message"] = stats["stored_blocks"] / max(1, stats["stored_messages"])
    stats["blocks_per_removed_message"] = stats["removed_blocks"] / max(1, stats["removed_messages"])
    return warm, meas, stats


def run_ingest(a, bs: int, impls: list[Impl]) -> dict:
    t0 = time.monotonic()
    warm, meas, stats = ingest_stream(a, bs)
    log(f"ingest bs={bs}: generated {stats['warmup_block_events']} warm-up + {stats['block_events']} measured "
        f"block events ({stats['stored_blocks']} stored / {stats['removed_blocks']} removed, "
        f"{stats['event_messages']} messages) in {time.monotonic() - t0:.1f}s")
    enc = msgspec.msgpack.Encoder()
    ids: dict[WorkerKey, int] = {}

    def wire(w, e):
        ids[w] = ids.get(w, -1) + 1
        return w, enc.encode(KvEventBatch(instance_id=w.instance_id, event_id=ids[w], events=[e]))
    warm_b = [wire(w, e) for w, e in warm]
    meas_b = [wire(w, e) for w, e in meas]
    stats["wire_bytes_per_block_event"] = sum(len(b) for _, b in meas_b) / stats["block_events"]
    dec = msgspec.msgpack.Decoder(KvEventBatch)
    n = stats["block_events"]
    runs = []
    for rep in range(a.repeats):
        order = impls if rep % 2 == 0 else impls[::-1]  # ABBA
        for impl in order:
            for path in ("apply", "decode+apply"):
                index = impl.KvIndexer(bs)
                apply = index.apply
                if path == "apply":
                    for w, e in warm:
                        apply(w, e)
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for w, e in meas:
                        apply(w, e)
                    t1, c1 = time.perf_counter(), time.process_time()
                else:
                    for w, b in warm_b:
                        for e in dec.decode(b).events:
                            apply(w, e)
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for w, b in meas_b:
                        for e in dec.decode(b).events:
                            apply(w, e)
                    t1, c1 = time.perf_counter(), time.process_time()
                rec = {"repeat": rep, "impl": impl.name, "path": path, "wall_s": t1 - t0, "cpu_s": c1 - c0,
                       "block_events_per_s": n / (t1 - t0),
                       "block_events_per_cpu_s": n / (c1 - c0) if c1 > c0 else None,
                       "ns_per_block_event": (t1 - t0) / n * 1e9, "index_hashes": len(index),
                       "indexed_blocks": sum(index.blocks_of(w) for w in index.workers())}
                runs.append(rec)
                log(f"  bs={bs} {impl.name} {path} r{rep}: {rec['block_events_per_s'] / 1e3:.0f}k block events/s "
                    f"({rec['ns_per_block_event']:.0f} ns each; per CPU s {rec['block_events_per_cpu_s'] / 1e3:.0f}k)")
                del index, apply
    # Both implementations must have built the same index.
    for path in ("apply", "decode+apply"):
        shapes = {(r["index_hashes"], r["indexed_blocks"]) for r in runs if r["path"] == path}
        assert len(shapes) == 1, f"implementations disagree on the index: {shapes}"
    out = {"stats": stats, "runs": runs, "results": {}}
    for impl in impls:
        out["results"][impl.name] = {}
        for path in ("apply", "decode+apply"):
            rs = [r for r in runs if r["path"] == path and r["impl"] == impl.name]
            out["results"][impl.name][path] = {
                "block_events_per_s_median": statistics.median(r["block_events_per_s"] for r in rs),
                "block_events_per_cpu_s_median": statistics.median(r["block_events_per_cpu_s"] for r in rs),
                "block_events_per_s_all": [r["block_events_per_s"] for r in rs]}
    if len(impls) == 2:
        cur, peer = impls[0].name, impls[1].name
        out["speedup"] = {}
        for path in ("apply", "decode+apply"):
            per = []
            for rep in range(a.repeats):
                x = {r["impl"]: r["block_events_per_s"] for r in runs if r["repeat"] == rep and r["path"] == path}
                per.append(x[cur] / x[peer])
            out["speedup"][path] = {"median": statistics.median(per), "per_repeat": per}
    return out


# --------------------------------------------------------------------------- decision
class DecisionIndex:
    """An index of about --indexed-blocks (worker, block) entries over --decision-workers workers,
    filled through `KvIndexer.apply`: every worker holds the shared system prompts; the rest is
    conversations of --prompt-tokens tokens, each held by one worker (a tenth also by a second
    one).  Deterministic for a seed, so two implementations get the same content."""

    def __init__(self, a, bs: int, impl: Impl, seed: int):
        self.bs = bs
        self.rng = rng = random.Random(seed)
        self.workers = [WorkerKey(f"worker-{i:02d}") for i in range(a.decision_workers)]
        self.router = impl.KvRouter(KvRouterConfig(), bs, rng=random.Random(seed))
        self.index = self.router.index
        self.corpus = Corpus(1 << 22, rng, as_array=True)
        self.systems = [self.corpus.take(a.system_tokens - a.system_tokens % bs) for _ in range(a.system_prompts)]
        self.prompt_tokens = a.prompt_tokens
        self._next_engine_hash = 1
        self._sys_engine: dict[tuple[WorkerKey, int], list[int]] = {}
        self.convs: list[tuple[int, int, int]] = []  # (system prompt, corpus offset, conversation number)
        t0 = time.monotonic()
        n_conv = 0
        while self.indexed() < a.indexed_blocks:
            s = rng.randrange(len(self.systems))
            off = self.corpus.offset(a.prompt_tokens)
            body = self.body(s, off, n_conv)
            held = [rng.choice(self.workers)]
            if rng.random() < 0.1:
                held.append(rng.choice([w for w in self.workers if w != held[0]]))
            for w in held:
                self.store(w, s, body)
            self.convs.append((s, off, n_conv))  # not the body: the benchmark's own memory stays small
            n_conv += 1
        # One prompt held in full by every worker, for the worst case.
        self.worst_body = self.corpus.take(a.prompt_tokens - len(self.systems[0]))
        for w in self.workers:
            self.store(w, 0, self.worst_body)
        self.build_s = time.monotonic() - t0

    def body(self, s: int, off: int, conv: int) -> list[int]:
        """A conversation's tokens after its system prompt (two leading tokens make it unique)."""
        return [conv // VOCAB, conv % VOCAB] + self.corpus.at(off, self.prompt_tokens - len(self.systems[s]) - 2)

    def _engine_hashes(self, n: int) -> list[int]:
        first = self._next_engine_hash
        self._next_engine_hash += n
        return list(range(first, first + n))

    def store(self, w: WorkerKey, s: int, body: list[int]) -> None:
        bs = self.bs
        sys_tokens = self.systems[s]
        key = (w, s)
        if key not in self._sys_engine:
            self._sys_engine[key] = self._engine_hashes(len(sys_tokens) // bs)
            self.index.apply(w, BlockStored.from_token_ids(block_hashes=self._sys_engine[key], parent_hash=None,
                                                           token_ids=sys_tokens, block_size=bs))
        n = len(body) // bs
        self.index.apply(w, BlockStored.from_token_ids(block_hashes=self._engine_hashes(n),
                                                       parent_hash=self._sys_engine[key][-1],
                                                       token_ids=body[:n * bs], block_size=bs))

    def indexed(self) -> int:
        return sum(self.index.blocks_of(w) for w in self.index.workers())

    def prompt(self, scenario: str, new_tokens: int) -> list[int]:
        n = self.prompt_tokens
        if scenario == "miss":
            return self.corpus.take(n)
        if scenario == "worst":
            return self.systems[0] + self.worst_body
        s, off, conv = self.convs[self.rng.randrange(len(self.convs))]
        body = self.body(s, off, conv)
        keep = n - len(self.systems[s]) - new_tokens
        return self.systems[s] + body[:keep] + self.corpus.take(new_tokens)


def run_decision(a, bs: int, impls: list[Impl]) -> dict:
    seed = a.seed + bs
    dis, full_gc = [], {}
    t = time.perf_counter()
    gc.collect()
    full_gc["before any index"] = {"ms": (time.perf_counter() - t) * 1e3, "tracked_objects": len(gc.get_objects())}
    for impl in impls:
        di = DecisionIndex(a, bs, impl, seed)
        indexed = di.indexed()
        # What one full (generation 2) collection costs with this index in memory: the frontend's
        # event loop stops for that long whenever Python decides to run one.
        t = time.perf_counter()
        gc.collect()
        full_gc[impl.name] = {"ms": (time.perf_counter() - t) * 1e3, "tracked_objects": len(gc.get_objects())}
        log(f"decision bs={bs} {impl.name}: index of {indexed} (worker, block) entries, {len(di.index)} distinct "
            f"hashes, {len(di.convs)} conversations, built in {di.build_s:.1f}s; a full GC now takes "
            f"{full_gc[impl.name]['ms']:.0f} ms ({full_gc[impl.name]['tracked_objects']} tracked objects)")
        dis.append(di)
    assert len({(d.indexed(), len(d.index)) for d in dis}) == 1, "implementations built different indexes"
    gc.collect()
    watch = GcWatch()
    gc.callbacks.append(watch)
    d0 = dis[0]
    out = {"block_size": bs, "workers": len(d0.workers), "indexed_blocks": d0.indexed(),
           "distinct_hashes": len(d0.index), "prompt_tokens": a.prompt_tokens, "prompt_blocks": a.prompt_tokens // bs,
           "full_gc_after_build": full_gc, "scenarios": {}}
    n, chunk = a.decisions, 250
    try:
        for scenario in ("miss", "typical", "worst"):
            prompts = [d0.prompt(scenario, a.new_tokens) for _ in range(min(n, 512))]
            for p in prompts:
                assert len(p) == a.prompt_tokens, (scenario, len(p))
            lat = {impl.name: [] for impl in impls}
            cpu = {impl.name: [] for impl in impls}
            overlaps = {impl.name: [] for impl in impls}
            gcs = {impl.name: GcWatch() for impl in impls}
            for impl, di in zip(impls, dis):  # warm-up
                for i in range(min(50, n)):
                    di.router.decide(f"w{i}", prompts[i % len(prompts)], di.workers)
                    di.router.finished(f"w{i}")
            for c, start in enumerate(range(0, n, chunk)):
                pairs = list(zip(impls, dis))
                for impl, di in (pairs if c % 2 == 0 else pairs[::-1]):  # alternate in chunks (ABBA)
                    router, workers, L, O, C = di.router, di.workers, lat[impl.name], overlaps[impl.name], cpu[impl.name]
                    thread_time, perf = time.thread_time, time.perf_counter
                    watch.pauses = gcs[impl.name].pauses
                    watch.active = True
                    for i in range(start, min(n, start + chunk)):
                        p = prompts[i % len(prompts)]
                        rid = f"{scenario}-{i}"
                        c0, t = thread_time(), perf()
                        d = router.decide(rid, p, workers)
                        t1, c1 = perf(), thread_time()
                        L.append((t1 - t) * 1e3)
                        C.append((c1 - c0) * 1e3)
                        router.finished(rid)
                        O.append(d.overlap_blocks)
                    watch.active = False
            per_impl = {}
            for impl, di in zip(impls, dis):
                # Breakdown on the same prompts: hashing alone, and find_matches alone.
                hash_ms, match_ms = [], []
                for i in range(min(n, 1000)):
                    p = prompts[i % len(prompts)]
                    t = time.perf_counter()
                    hs = impl.block_hashes(p, bs)
                    t1 = time.perf_counter()
                    di.index.find_matches(hs)
                    t2 = time.perf_counter()
                    hash_ms.append((t1 - t) * 1e3)
                    match_ms.append((t2 - t1) * 1e3)
                L = lat[impl.name]
                rec = {"decisions": n, "p50_ms": pct(L, 50), "p90_ms": pct(L, 90), "p99_ms": pct(L, 99),
                       "max_ms": max(L), "mean_ms": statistics.fmean(L),
                       "cpu_p50_ms": pct(cpu[impl.name], 50), "cpu_p99_ms": pct(cpu[impl.name], 99),
                       "overlap_blocks_median": statistics.median(overlaps[impl.name]),
                       "hash_p50_ms": pct(hash_ms, 50), "find_matches_p50_ms": pct(match_ms, 50),
                       "find_matches_p99_ms": pct(match_ms, 99), "gc": gcs[impl.name].summary()}
                per_impl[impl.name] = rec
                g2 = rec["gc"]["gen2"]
                log(f"  bs={bs} {scenario} {impl.name}: decide p50 {rec['p50_ms']:.3f} p99 {rec['p99_ms']:.3f} "
                    f"(thread CPU p99 {rec['cpu_p99_ms']:.3f}) "
                    f"max {rec['max_ms']:.2f} ms (hash {rec['hash_p50_ms']:.3f}, find_matches "
                    f"{rec['find_matches_p50_ms']:.3f} ms; overlap {rec['overlap_blocks_median']} blocks; "
                    f"gen2 GCs {g2['count']}, max {g2['max_ms']:.1f} ms)")
            assert len({tuple(o) for o in overlaps.values()}) == 1, "implementations chose different overlaps"
            out["scenarios"][scenario] = per_impl
    finally:
        gc.callbacks.remove(watch)
    del dis
    gc.collect()
    return out


# --------------------------------------------------------------------------- per-block costs
def cost_breakdown(a, bs: int) -> dict:
    """What one block event costs, piece by piece (best of 5 timeit runs, ns per block), on a
    BlockStored of --breakdown-blocks blocks and the BlockRemoved of the same blocks: where the
    ingest time goes, for the reading of the results."""
    import timeit
    rng = random.Random(a.seed)
    nb = a.breakdown_blocks
    toks = [rng.randrange(1000, VOCAB) for _ in range(nb * bs)]
    hashes = [rng.getrandbits(63) for _ in range(nb)]
    stored = BlockStored.from_token_ids(block_hashes=hashes, parent_hash=None, token_ids=toks, block_size=bs)
    removed = BlockRemoved(block_hashes=hashes)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KvEventBatch)
    b_stored = enc.encode(KvEventBatch(instance_id="w00", event_id=1, events=[stored]))
    b_removed = enc.encode(KvEventBatch(instance_id="w00", event_id=2, events=[removed]))
    impl = current_impl()
    from turbine.router.hashing import packed_block_hashes
    packed = stored.tokens
    w = WorkerKey("w00")

    def per_block(fn, number=2000):
        return min(timeit.repeat(fn, number=number, repeat=5)) / number / nb * 1e9

    def store_remove():
        index = impl.KvIndexer(bs)
        index.apply(w, stored)
        index.apply(w, removed)
    out = {"block_size": bs, "blocks_per_event": nb,
           "decode_stored_ns": per_block(lambda: dec.decode(b_stored)),
           "decode_removed_ns": per_block(lambda: dec.decode(b_removed)),
           # Prompts only (the decision path): events carry their tokens packed already.
           "tokens_to_u32_ns": per_block(lambda: array("I", toks).tobytes()),
           "block_hashes_ns": per_block(lambda: impl.block_hashes(toks, bs)),
           "packed_block_hashes_ns": per_block(lambda: packed_block_hashes(packed, bs)),
           "apply_store_and_remove_ns": per_block(store_remove)}
    out["hashing_proper_ns"] = out["packed_block_hashes_ns"]
    out["bookkeeping_store_and_remove_ns"] = out["apply_store_and_remove_ns"] - out["packed_block_hashes_ns"]
    out["decode_ns_per_token"] = out["decode_stored_ns"] / bs
    log(f"breakdown bs={bs}: " + ", ".join(f"{k} {v:.0f}" for k, v in out.items() if k.endswith("_ns")))
    return out


# --------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    a = result["config"]
    impls = result["impls"]
    lines = []
    if result["ingest"]:
        lines += ["### Ingest: block events per second, one thread",
                  "",
                  f"{a['ingest_workers']} workers, multi-turn chat events from the mocker's block pool (steady state: "
                  "pools full, LRU eviction); one block event = one block stored or removed. Median of "
                  f"{a['repeats']} runs (all runs in brackets); `apply`: KvIndexer.apply on decoded events; "
                  "`decode+apply`: msgspec decode of each KvEventBatch's bytes, then apply.",
                  "",
                  "| block size | implementation | measured block events (stored / removed) | blocks per Stored / Removed "
                  "| **apply** (k block events/s) | per CPU s (k) | **decode+apply** (k/s) | per CPU s (k) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for bs, r in sorted(result["ingest"].items(), key=lambda kv: int(kv[0])):
            s = r["stats"]
            for name in impls:
                ap, da = r["results"][name]["apply"], r["results"][name]["decode+apply"]
                lines.append(
                    f"| {bs} | {name} | {s['block_events']} ({s['stored_blocks']} / {s['removed_blocks']}) "
                    f"| {s['blocks_per_stored_message']:.1f} / {s['blocks_per_removed_message']:.1f} "
                    f"| **{ap['block_events_per_s_median'] / 1e3:.0f}** "
                    f"({', '.join(f'{x / 1e3:.0f}' for x in ap['block_events_per_s_all'])}) "
                    f"| {ap['block_events_per_cpu_s_median'] / 1e3:.0f} "
                    f"| **{da['block_events_per_s_median'] / 1e3:.0f}** "
                    f"({', '.join(f'{x / 1e3:.0f}' for x in da['block_events_per_s_all'])}) "
                    f"| {da['block_events_per_cpu_s_median'] / 1e3:.0f} |")
            if "speedup" in r:
                sp = r["speedup"]
                lines.append(f"| {bs} | *ratio* | | | **{sp['apply']['median']:.2f}×** "
                             f"({', '.join(f'{x:.2f}' for x in sp['apply']['per_repeat'])}) | "
                             f"| **{sp['decode+apply']['median']:.2f}×** "
                             f"({', '.join(f'{x:.2f}' for x in sp['decode+apply']['per_repeat'])}) | |")
    if result.get("breakdown"):
        lines += ["", "### Where an ingested block's time goes (ns per block, this tree)", "",
                  "| block size | decode BlockStored (per token) | decode BlockRemoved "
                  "| tokens → u32 bytes (prompts only) | xxh3 chain over the packed tokens "
                  "| index bookkeeping, store + remove | **stored + removed block, decode+apply** |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for bs, b in sorted(result["breakdown"].items(), key=lambda kv: int(kv[0])):
            total = b["decode_stored_ns"] + b["decode_removed_ns"] + b["apply_store_and_remove_ns"]
            lines.append(f"| {bs} | {b['decode_stored_ns']:.0f} ({b['decode_ns_per_token']:.1f}) | {b['decode_removed_ns']:.0f} "
                         f"| {b['tokens_to_u32_ns']:.0f} | {b['hashing_proper_ns']:.0f} "
                         f"| {b['bookkeeping_store_and_remove_ns']:.0f} | **{total:.0f}** "
                         f"(≤ {2e9 / total / 1e3:.0f}k block events/s) |")
    if result["decision"]:
        lines += ["", "### Decision: `KvRouter.decide` latency",
                  "",
                  f"{a['decisions']} decisions per scenario and implementation (alternating in chunks of 250), GC on.",
                  "",
                  "| block size | workers | indexed blocks (distinct hashes) | prompt tokens (blocks) | scenario "
                  "| implementation | overlap blocks | **p50 (ms)** | p90 | **p99 (ms)** | max | thread CPU p99 "
                  "| hash p50 | find_matches p50 / p99 | gen2 GCs (max ms) |",
                  "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for bs, r in sorted(result["decision"].items(), key=lambda kv: int(kv[0])):
            for scen, per in r["scenarios"].items():
                for name in impls:
                    s = per[name]
                    g2 = s["gc"]["gen2"]
                    lines.append(f"| {bs} | {r['workers']} | {r['indexed_blocks']} ({r['distinct_hashes']}) "
                                 f"| {r['prompt_tokens']} ({r['prompt_blocks']}) | {scen} | {name} "
                                 f"| {s['overlap_blocks_median']:.0f} | **{s['p50_ms']:.3f}** | {s['p90_ms']:.3f} "
                                 f"| **{s['p99_ms']:.3f}** | {s['max_ms']:.2f} | {s['cpu_p99_ms']:.3f} | {s['hash_p50_ms']:.3f} "
                                 f"| {s['find_matches_p50_ms']:.3f} / {s['find_matches_p99_ms']:.3f} "
                                 f"| {g2['count']} ({g2['max_ms']:.0f}) |")
        lines += ["", "A full garbage collection with the 1M-block index in memory (the frontend's event loop stops "
                  "for this long whenever Python runs one):", ""]
        for bs, r in sorted(result["decision"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"- block size {bs}: " + "; ".join(
                f"{name}: {g['ms']:.0f} ms ({g['tracked_objects']} GC-tracked objects in the process)"
                for name, g in r["full_gc_after_build"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-sizes", type=parse_int_list, default=[16, 64, 128],
                   help="KV block sizes (tokens); 128 is the vLLM CPU worker's, 16/64 common on GPUs")
    p.add_argument("--repeats", type=int, default=5, help="ingest runs per block size and path (medians reported)")
    p.add_argument("--skip-ingest", action="store_true")
    p.add_argument("--skip-decision", action="store_true")
    g = p.add_argument_group("ingest workload")
    g.add_argument("--ingest-workers", type=int, default=8)
    g.add_argument("--ingest-events", type=int, default=300_000, help="measured block events per run")
    g.add_argument("--ingest-cache-tokens", type=int, default=131072, help="KV cache per worker, in tokens")
    g.add_argument("--conversations", type=int, default=256)
    g.add_argument("--user-tokens", type=int, default=300, help="mean new user tokens per turn")
    g.add_argument("--answer-tokens", type=int, default=200, help="mean answer tokens per turn")
    g.add_argument("--max-context", type=int, default=8192, help="a conversation restarts beyond this")
    g = p.add_argument_group("decision")
    g.add_argument("--decision-workers", type=int, default=64)
    g.add_argument("--indexed-blocks", type=int, default=1_000_000)
    g.add_argument("--prompt-tokens", type=int, default=8192)
    g.add_argument("--new-tokens", type=int, default=512, help="typical scenario: unseen tokens at the end")
    g.add_argument("--decisions", type=int, default=5000, help="decisions per scenario")
    g.add_argument("--breakdown-blocks", type=int, default=8, help="blocks per event in the per-block cost breakdown")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pin-cpu", type=int, default=None, help="pin this process to one CPU (sched_setaffinity)")
    p.add_argument("--compare-ref", default=None,
                   help="also measure turbine/router/{hashing,indexer}.py as of this git revision (8559aaa: "
                        "before the bit-mask indexer and one-shot hashing), alternating with this tree's, same run; "
                        "a revision before wire version 2 reads BlockStored.token_ids, which unpacks the packed "
                        "tokens: not the cost of decoding v1's int lists)")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/routing/indexer_micro-<date>.json)")
    a = p.parse_args(argv)
    if a.pin_cpu is not None:
        os.sched_setaffinity(0, {a.pin_cpu})
    out_path = Path(a.out or REPO_ROOT / "benchmarks" / "results" / "routing" / f"indexer_micro-{_dt.date.today().isoformat()}.json")
    result = {"benchmark": "indexer_micro", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "argv": sys.argv, "config": vars(a), "python": sys.version.split()[0],
              "platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
              "ingest": {}, "decision": {}}
    wait_quiet()  # not while a pytest run shares the cores
    impls = [current_impl()] + ([peer_impl(a.compare_ref)] if a.compare_ref else [])
    result["impls"] = [i.name for i in impls]
    result["tree_diff_router"] = subprocess.run(
        ["git", "diff", "--stat", "HEAD", "--", "turbine/router"], cwd=REPO_ROOT, capture_output=True,
        text=True).stdout.strip()
    result["breakdown"] = {}
    for bs in a.block_sizes:
        if not a.skip_ingest:
            result["breakdown"][str(bs)] = cost_breakdown(a, bs)
            result["ingest"][str(bs)] = run_ingest(a, bs, impls)
            gc.collect()
        if not a.skip_decision:
            result["decision"][str(bs)] = run_decision(a, bs, impls)
    result["load_avg_end"] = os.getloadavg()
    md = markdown(result)
    result["markdown"] = md
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print(md)
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

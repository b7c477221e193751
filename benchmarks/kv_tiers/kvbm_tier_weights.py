"""The KV router's tier weights, measured on the real CPU engine: what loading a prompt's blocks from
the host or the disk tier (--connector kvbm) costs, as a share of computing them.

One Turbine vLLM worker (SmolLM2-135M float32, the CPU build's 128-token blocks, an engine cache of one
prompt, a host tier of two) and a frontend. Each round sends fresh prompts and repeats them so that the
repeats find their full blocks in the engine, in the host tier and only on disk (even rounds host
before disk, odd rounds disk before host), and times each request's first token (streaming, max_tokens=1). Each request is classified by what the worker's
/metrics say it was served from (vLLM's cached-prompt-tokens by source), not by the plan, so an LRU
surprise only moves a sample to its true class.

    weight(tier) = (median TTFT from tier - median TTFT engine hit) / (median TTFT fresh - median TTFT engine hit)

The engine hit still computes the prompt's partial last block and one token, as every class does, so
the difference is the full blocks' cost: computed (fresh), loaded (tier) or already there (engine).
The shared tier is the disk tier's file code on a directory others also write (on this host a local
directory): it gets the disk weight unless measured on a network filesystem.

    flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.kv_tiers.kvbm_tier_weights --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import log
from benchmarks.lib.stack import Stack, start_turbine
from turbine.runtime.ports import free_port

from turbine.model.prepare import DEFAULT_MODEL

BLOCK = 128
FULL = 8  # full blocks per prompt
PROMPT_LEN = FULL * BLOCK + 16
BLOCK_BYTES = 30 * 3 * BLOCK * 128 * 4  # SmolLM2-135M float32: layers × KV heads × tokens × (K+V) × 4


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]


def cached_by_source(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.match(r'vllm:prompt_tokens_cached_by_source_total\{.*source="([a-z_]+)".*\} (\S+)', line):
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def ttft(client, tokens: list[int]) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=DEFAULT_MODEL, prompt=tokens, max_tokens=1, temperature=0, stream=True)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    return first


def classify(delta: dict[str, float]) -> str:
    full = FULL * BLOCK
    if delta.get("device", 0) >= full:
        return "engine"
    if delta.get("host", 0) >= full:
        return "host"
    if delta.get("disk", 0) >= full:
        return "disk"
    if not any(delta.values()):
        return "fresh"
    return "mixed"  # part from one place, part from another: not used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results file (default: benchmarks/results/kv_tiers/kvbm_tier_weights-<time>.json)")
    args = ap.parse_args()
    from openai import OpenAI

    run_dir = Path(tempfile.mkdtemp(prefix="kvbm_weights_"))
    stack = Stack("kvbm", run_dir, "kvbm")
    host_gb = (2 * FULL + 0.5) * BLOCK_BYTES / 2**30  # two prompts' full blocks (and less than one more block)
    worker = ["-m", "turbine.vllm", "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK),
              "--max-model-len", str(PROMPT_LEN + 64), "--num-gpu-blocks-override", str(FULL + 2),
              "--connector", "kvbm", "--kv-host-cache-gb", f"{host_gb:.9f}", "--kv-disk-cache-gb", "2",
              "--kv-disk-cache-dir", str(run_dir / "disk"), "--system-port", str(port := free_port())]
    start_turbine(stack, sys.executable, worker, worker_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    worker_url = f"http://127.0.0.1:{port}"
    samples: dict[str, list[float]] = {}
    try:
        stack.wait_ready(lambda: stack.models_ready(DEFAULT_MODEL, True), 600)
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        rng = random.Random(args.seed)
        ttft(client, prompt(rng))  # warm-up (first request's one-off costs)

        def send(tokens: list[int]) -> None:
            before = cached_by_source(worker_url)
            t = ttft(client, tokens)
            time.sleep(0.5)  # the admission step's stats reach /metrics a step or two later
            after = cached_by_source(worker_url)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
            kind = classify(delta)
            samples.setdefault(kind, []).append(t)
            log(f"  {kind:6s} {t * 1000:8.1f} ms  cached tokens by source: {delta}")

        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            p, q, s, u = (prompt(rng) for _ in range(4))
            send(p)  # fresh
            send(p)  # engine hit
            send(q)  # fresh; pushes p out of the engine (p stays in host and disk)
            if r % 2 == 0:
                send(p)  # host (p is now the host tier's most recent, and in the engine)
                send(s)  # fresh
                send(u)  # fresh; p's host copy is the least recently used: out; disk only
                send(p)  # disk
            else:
                send(s)  # fresh; p's host copy is out (host: q, s); disk only
                send(p)  # disk (promoted: host q is out)
                send(u)  # fresh; pushes p out of the engine, not out of the host tier (host: p, u)
                send(p)  # host
    finally:
        stack.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {"host": "this 2-core AVX2 CPU host, shared with other helpers", "rounds": args.rounds,
              "block_tokens": BLOCK, "full_blocks": FULL, "block_bytes": BLOCK_BYTES,
              "samples_ms": {k: [round(x * 1000, 1) for x in v] for k, v in samples.items()},
              "median_ms": {k: round(v * 1000, 1) for k, v in med.items()}}
    if {"fresh", "engine"} <= med.keys():
        span = med["fresh"] - med["engine"]
        result["weights"] = {t: round((med[t] - med["engine"]) / span, 3) for t in ("host", "disk") if t in med}
        result["per_block_ms"] = {"compute": round(span / FULL * 1000, 1), **{
            t: round((med[t] - med["engine"]) / FULL * 1000, 1) for t in ("host", "disk") if t in med}}
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / "kv_tiers" / f"kvbm_tier_weights-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

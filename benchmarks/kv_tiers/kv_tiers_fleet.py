#!/usr/bin/env python3
r"""Multi-tier KV cache on a simulated fleet (issue #18): returning conversations with no tiers, with
tiers and engine-only routing, and with tiers and tier-aware routing.

Each run starts, on a private file-discovery folder (benchmarks/lib/stack.py, via kv_routing_fleet):
  python -m turbine.mocker --num-workers 8 --profile benchmarks/results/mocker/mocker_profile-2026-11-25.json
        --block-size 128 --num-gpu-blocks N [--kv-host-cache-gb G] ...
  python -m turbine.frontend --router-mode kv [--no-router-kv-tiers]
and drives kv_routing_fleet's multi-turn chat (each conversation its own system prompt here, so the
working set is every conversation's history), sized so that the working set is several times the
fleet's engine KV capacity: a conversation's history has left its worker's engine by the time it
returns. Modes:
  none         no tiers (the KV router, following engine events);
  engine-only  every mocker engine has a host tier (--kv-host-cache-gb), the router ignores tier
               events (--no-router-kv-tiers): it sees a returning conversation's blocks nowhere;
  tier-aware   the same tiers, the router weighs tier blocks (TIER_WEIGHTS): it sends a returning
               conversation back to the worker whose tier holds its history.
Modes alternate (in order, then reversed on the next repeat); medians over repeats. Each run holds
--lock (if given). Reported: returning-turn TTFT p50/p99 (turns after the first), first-turn TTFT p50,
request and output-token throughput, the cache hit rate (usage cached_tokens: engine hits plus blocks
loaded from a tier, as vLLM counts them), the blocks loaded from the tiers (turbine_mocker_kvbm_hits),
and the ratios against `none` of the same repeat.

  .venv/bin/python -m benchmarks.kv_tiers.kv_tiers_fleet --repeats 2 --lock /tmp/turbine-engine.lock \
      --out benchmarks/results/kv_tiers/kv_tiers_fleet-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import fcntl
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lib.load import drive
from benchmarks.lib.metrics import scrape, worker_spread
from benchmarks.lib.paths import REPO_ROOT, default_model
from benchmarks.lib.proc import log
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.results import dump_json
from benchmarks.lib.stats import fmt, median, pct, ratio

from benchmarks.routing import kv_routing_fleet as kf

MODES = ("none", "engine-only", "tier-aware")
BLOCK_SIZE = 128  # the real vLLM CPU worker's


def mode_args(a, mode: str) -> argparse.Namespace:
    """kv_routing_fleet's stack settings with this mode's mocker and frontend flags."""
    m = argparse.Namespace(**vars(a))
    tiers = f"--kv-host-cache-gb {a.host_cache_gb}" if mode != "none" else ""
    m.mocker_args = f"{tiers} {a.mocker_args}".strip()
    m.frontend_args = f"{'--no-router-kv-tiers' if mode == 'engine-only' else ''} {a.frontend_args}".strip()
    return m


@contextlib.contextmanager
def engine_lock(path: str | None):
    if not path:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one benchmark at a time on a host shared with others
        yield


def run_one(a, mode: str, workload, rep: int, run_dir: Path) -> dict:
    tag = f"r{rep}_{mode}"
    m = mode_args(a, mode)
    try:
        waited = wait_quiet(max_wait_s=a.quiet_wait_s)
    except RuntimeError:
        waited = None  # still a pytest running: measured anyway, and said so
    with engine_lock(a.lock):
        st = kf.start_stack(m, "kv", "chat", run_dir, tag)
        try:
            w0 = time.monotonic()
            records, _ = asyncio.run(drive(workload, st.base_url))
            wall = time.monotonic() - w0
            mocker = [x for port in st.metrics_ports for x in scrape(f"http://127.0.0.1:{port}/metrics")]
            died = [p.name for p in st.procs if not p.alive()]
        finally:
            st.stop()
    ok = [r for r in records if r["error"] is None]
    ttft = {k: [(r["t_first"] - r["t_send"]) * 1e3 for r in ok if (r["turn"] > 0) == k] for k in (False, True)}
    t0 = min(r["t_send"] for r in records)
    t1 = max((r["t_end"] for r in ok), default=t0)
    prompt = sum(r["prompt_tokens"] for r in ok if r["turn"] > 0)
    tier_hits = sum(v for n, labels, v in mocker if n == "turbine_mocker_kvbm_hits_total")
    out = {
        "repeat": rep, "mode": mode, "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "error_samples": sorted({r["error"] for r in records if r["error"]})[:5],
        "returning_ttft_p50_ms": pct(ttft[True], 50), "returning_ttft_p99_ms": pct(ttft[True], 99),
        "first_turn_ttft_p50_ms": pct(ttft[False], 50), "returning": len(ttft[True]),
        "request_per_s": len(ok) / (t1 - t0) if t1 > t0 else None,
        "output_tok_s": sum(r["completion_tokens"] for r in ok) / (t1 - t0) if t1 > t0 else None,
        "returning_hit_rate": sum(r["cached_tokens"] for r in ok if r["turn"] > 0) / prompt if prompt else None,
        "tier_hit_blocks": tier_hits, "makespan_s": t1 - t0, "wall_s": wall, "pytest_wait_s": waited,
        "workers": worker_spread(mocker), "died": died, "mocker_argv": st.argv_mocker,
        "frontend_argv": st.argv_frontend, "logs": [str(p.log_path) for p in st.procs],
    }
    log(f"{tag}: {out['ok']}/{out['requests']} ok, returning TTFT p50 {fmt(out['returning_ttft_p50_ms'])} "
        f"p99 {fmt(out['returning_ttft_p99_ms'])} ms, first-turn p50 {fmt(out['first_turn_ttft_p50_ms'])} ms, "
        f"{fmt(out['request_per_s'], 2)} req/s, returning hit {fmt((out['returning_hit_rate'] or 0) * 100)} %, "
        f"tier hits {tier_hits:.0f} blocks, {wall:.0f}s")
    if died or out["errors"]:
        log(f"{tag}: errors {out['error_samples']} died {died}")
    return out


KEYS = ("returning_ttft_p50_ms", "returning_ttft_p99_ms", "first_turn_ttft_p50_ms", "request_per_s", "output_tok_s",
        "returning_hit_rate", "tier_hit_blocks")


def summarize(runs: list[dict], modes: list[str]) -> dict:
    summary = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        row = {k: median([r[k] for r in rs]) for k in KEYS}
        row.update(runs=len(rs), errors=sum(r["errors"] for r in rs))
        # Against `none` of the same repeat, then the median over repeats.
        per = []
        for r in rs:
            peer = next((p for p in runs if p["mode"] == "none" and p["repeat"] == r["repeat"]), None)
            if peer is not None:
                per.append({"p50": ratio(peer["returning_ttft_p50_ms"], r["returning_ttft_p50_ms"]),
                            "p99": ratio(peer["returning_ttft_p99_ms"], r["returning_ttft_p99_ms"]),
                            "req_s": ratio(r["request_per_s"], peer["request_per_s"])})
        row["vs_none_per_repeat"] = per
        for k in ("p50", "p99", "req_s"):
            row[f"vs_none_{k}"] = median([p[k] for p in per])
        summary[mode] = row
    return summary


def markdown(summary: dict, runs: list[dict]) -> str:
    lines = ["| mode | returning TTFT p50 (ms) | p99 (ms) | **p50: none / mode** | p99: none / mode | first-turn TTFT p50 "
             "(ms) | req/s (× none) | output tok/s | returning hit rate | blocks loaded from tiers | runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, s in summary.items():
        lines.append(f"| {mode} | {fmt(s['returning_ttft_p50_ms'])} | {fmt(s['returning_ttft_p99_ms'])} "
                     f"| **{fmt(s['vs_none_p50'], 2)}×** | {fmt(s['vs_none_p99'], 2)}× "
                     f"| {fmt(s['first_turn_ttft_p50_ms'])} | {fmt(s['request_per_s'], 2)} ({fmt(s['vs_none_req_s'], 2)}×) "
                     f"| {fmt(s['output_tok_s'])} | {fmt((s['returning_hit_rate'] or 0) * 100)} % "
                     f"| {fmt(s['tier_hit_blocks'])} | {s['runs']} |")
    lines += ["", "Every run:", "", "| repeat | mode | ok / sent | returning TTFT p50 / p99 (ms) | first-turn p50 (ms) "
              "| req/s | returning hit rate | tier hits (blocks) | requests per worker min / max |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['repeat']} | {r['mode']} | {r['ok']} / {r['requests']} | {fmt(r['returning_ttft_p50_ms'])} / "
                     f"{fmt(r['returning_ttft_p99_ms'])} | {fmt(r['first_turn_ttft_p50_ms'])} | {fmt(r['request_per_s'], 2)} "
                     f"| {fmt((r['returning_hit_rate'] or 0) * 100)} % | {r['tier_hit_blocks']:.0f} "
                     f"| {r['workers']['min']} / {r['workers']['max']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--lock", default=os.environ.get("TURBINE_ENGINE_LOCK"),
                   help="flock this file around each run (e.g. /tmp/turbine-engine.lock on a shared host)")
    p.add_argument("--quiet-wait-s", type=float, default=300.0,
                   help="wait at most this long for a running pytest to end before a run (then run anyway)")
    g = p.add_argument_group("fleet")
    g.add_argument("--num-workers", type=int, default=8)
    g.add_argument("--num-gpu-blocks", type=int, default=20, help="engine KV blocks of 128 tokens per worker")
    g.add_argument("--host-cache-gb", type=float, default=0.75,
                   help="--kv-host-cache-gb per worker (0.75 GiB: 273 blocks of SmolLM2's 2.9 MB)")
    g.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    g.add_argument("--profile", default=str(REPO_ROOT / "benchmarks/results/mocker/mocker_profile-2026-11-25.json"))
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--mocker-args", default="", help="extra mocker flags (every mode)")
    g.add_argument("--frontend-args", default="", help="extra frontend flags (every mode)")
    g = p.add_argument_group("chat workload (kv_routing_fleet's; one system prompt per conversation)")
    g.add_argument("--conversations", type=int, default=96)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=600)
    g.add_argument("--user-tokens", type=int, default=80)
    g.add_argument("--answer-tokens", type=int, default=32)
    g.add_argument("--session-rate", type=float, default=2.0, help="conversations started per second (Poisson)")
    g.add_argument("--turn-gap-s", type=float, default=8.0, help="mean time between a conversation's turns")
    g.add_argument("--min-think-s", type=float, default=0.2)
    p.add_argument("--startup-timeout", type=float, default=120)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "kv_tiers" / f"kv_tiers_fleet-{today}.json"))
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m} ({', '.join(MODES)})")
    # What kv_routing_fleet's stack and chat workload read.
    a.engine, a.chat_block_size, a.system_prompts = "mocker", BLOCK_SIZE, a.conversations
    a.model = a.model or default_model(a.python)
    run_dir = Path(a.work_dir or f"/tmp/turbine-kv-tiers-fleet-{_dt.datetime.now():%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    from turbine.frontend.models.tokenizer import TextTokenizer
    workload = kf.ChatWorkload(a, TextTokenizer.from_dir(a.model))
    for s in workload.sessions:  # each conversation its own system prompt (ChatWorkload draws them)
        s["system"] = s["id"]
    describe = workload.describe()
    # The working set: every conversation's final context, in full blocks; against the fleet's engines.
    final = [describe["system_tokens"][s["system"]] + a.turns * (a.user_tokens + a.answer_tokens)
             for s in workload.sessions]
    working_blocks = sum(min(n, a.max_model_len) // BLOCK_SIZE for n in final)
    describe["working_set_blocks_estimate"] = working_blocks
    describe["fleet_engine_blocks"] = a.num_workers * a.num_gpu_blocks
    describe["working_set_over_engine_capacity"] = working_blocks / (a.num_workers * a.num_gpu_blocks)
    log(f"workload: {json.dumps(describe)}")

    started = time.time()
    runs, failures = [], 0
    for rep in range(a.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            try:
                runs.append(run_one(a, mode, workload, rep, run_dir))
            except (RuntimeError, OSError) as e:
                failures += 1
                log(f"r{rep} {mode}: FAILED: {e}")
    summary = summarize(runs, modes)
    table = markdown(summary, runs)
    print(table)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "turbine"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.strip()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_json({
        "benchmark": "kv_tiers_fleet", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv], "commit": commit,
        "turbine_tree_changes": dirty.splitlines(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg(),
                 "note": "2-core AVX2 CPU host shared with other helpers"},
        "config": vars(a), "workload": describe, "work_dir": str(run_dir), "summary": summary, "runs": runs,
        "markdown": table}) + "\n")
    log(f"wrote {out} ({time.time() - started:.0f}s)")
    return 1 if failures or any(r["errors"] or r["died"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

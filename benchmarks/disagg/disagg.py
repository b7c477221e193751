#!/usr/bin/env python3
r"""Disaggregated prefill/decode (issue #5): aggregated vs disaggregated at equal worker count.

Three parts (`--part`), each on private file discovery (benchmarks/lib/stack.py), one stack at a time:

mocker     Simulated workers at --speedup-ratio 1 with the calibrated CPU profile:
           N aggregated workers (`turbine.mocker --num-workers N`) vs P prefill + D decode workers
           (`turbine.mocker --disaggregation-mode prefill|decode`, KV transfer model at
           --kv-transfer-bandwidth GB/s), behind `turbine.frontend --router-mode round-robin`
           (default --max-local-prefill-length 256).  Pairs `--pairs 2:1:1,4:2:2` (workers:P:D).
vllm       Real vLLM CPU workers (`turbine.vllm`, SmolLM2-135M, default dtype): 2 aggregated vs
           `--is-prefill-worker --connector nixl` + `--is-decode-worker --connector nixl`.
           The engines share the machine's cores: record, do not target.
crossover  Real 1P+1D vLLM CPU workers and two frontends on the same workers: one with
           --max-local-prefill-length 0 (every prompt prefilled remotely, KV over NIXL), one with a
           huge value (every prompt prefilled on the decode worker).  Single requests, one at a
           time, at each prompt length; TTFT medians over --repeats; the suggested
           --max-local-prefill-length: the shortest length from which on the hand-off adds at
           most --tolerance to TTFT while a local prefill would stall decode >= --stall-ms.

Load (mocker, vllm): open-loop Poisson arrivals at --rate requests/s (the same schedule for both
setups, fixed --seed), --short-frac short chat-like requests (--short-in tokens in, --short-out
out) and the rest long prompts (--long-in in, --long-out out), random token ids (no shared
prefixes), `/v1/completions` streaming with ignore_eos, from this process (asyncio + httpx).

Reported: TTFT p50/p99 (all, short, long), ITL p50/p99 pooled over every inter-token gap of every
stream (a gap = time between two consecutive content chunks; what a reader sees stall), the
per-request mean ITL p50/p99 ((last - first token) / (tokens - 1), aiperf's definition), the
longest gap, gaps > 1 s, output tokens/s (completion tokens / first send to last answer), and for
disaggregated setups the frontend's `turbine_frontend_prefills_total` (remote, local_fallback) and
how many long prompts were prefilled locally anyway (prefill workers saturated).  Setups alternate
(agg, disagg | disagg, agg); values are medians over repeats.

  .venv/bin/python -m benchmarks.disagg.disagg --part mocker --repeats 2
  .venv/bin/python -m benchmarks.disagg.disagg --part vllm --repeats 2
  .venv/bin/python -m benchmarks.disagg.disagg --part crossover --repeats 3

--request-planes tcp,nats (mocker, vllm): instead of aggregated vs disaggregated, the disaggregated setup of
each pair once per request plane (every process of the stack on it; nats through a private nats-server
that is one of the stack's processes, its CPU recorded), alternating as above:

  .venv/bin/python -m benchmarks.disagg.disagg --part vllm --request-planes tcp,nats --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.lib.load import read_stream
from benchmarks.lib.metrics import scrape
from benchmarks.lib.paths import REPO_ROOT, default_model, versions
from benchmarks.lib.proc import exit_on_sigterm, http_get_json, log, proc_cpu_s, tail
from benchmarks.lib.quiet import is_pytest, wait_quiet
from benchmarks.lib.results import dump_json
from benchmarks.lib.stack import Stack, start_nats, turbine_env
from benchmarks.lib.stats import fmt, median, pct, ratio
from turbine.runtime.ports import free_port


SERVED = "smollm2-135m-instruct"
PARTS = ("mocker", "vllm", "crossover")
PROFILE = REPO_ROOT / "benchmarks/results/mocker/mocker_profile-2026-11-26.json"
HUGE = 10**9  # --max-local-prefill-length that keeps every prompt on the decode worker


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


# --------------------------------------------------------------------------- workload
def make_workload(a, rate: float) -> list[dict]:
    """Poisson arrivals; short or long requests; random token ids (unique prompts)."""
    rng = random.Random(a.seed)
    items, t = [], 0.0
    for i in range(a.requests):
        t += rng.expovariate(rate) if i else 0.0
        long = rng.random() >= a.short_frac
        isl = rng.randint(*(a.long_in if long else a.short_in))
        osl = rng.randint(*(a.long_out if long else a.short_out))
        items.append({"at": t, "kind": "long" if long else "short", "max_tokens": osl,
                      "prompt_ids": [rng.randrange(1000, 49152) for _ in range(isl)]})
    return items


def describe(items: list[dict], rate: float) -> dict:
    d = {"requests": len(items), "rate_per_s": rate, "schedule_span_s": items[-1]["at"] if items else 0}
    for kind in ("short", "long"):
        xs = [i for i in items if i["kind"] == kind]
        d[kind] = {"requests": len(xs), "prompt_tokens": sum(len(i["prompt_ids"]) for i in xs),
                   "output_tokens": sum(i["max_tokens"] for i in xs)}
    return d


async def stream_one(client, url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """One streaming completion; the time of every content chunk."""
    body = {"model": SERVED, "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    rec = {"t_send": time.monotonic(), "times": [], "prompt_tokens": None, "completion_tokens": None,
           "cached_tokens": None, "error": None}

    def on_chunk(chunk: dict, now: float) -> None:
        if any(c.get("text") for c in chunk.get("choices") or ()):
            rec["times"].append(now)

    await read_stream(client, f"{url}/v1/completions", body, rec, on_chunk)
    if rec["error"] is None and (not rec["times"] or rec["completion_tokens"] != max_tokens):
        rec["error"] = f"no content or wrong token count ({rec['completion_tokens']} of {max_tokens})"
    return rec


async def drive(url: str, items: list[dict]) -> list[dict]:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits) as client:
        t0 = time.monotonic() + 0.5

        async def one(item):
            await asyncio.sleep(max(0.0, t0 + item["at"] - time.monotonic()))
            rec = await stream_one(client, url, item["prompt_ids"], item["max_tokens"])
            rec.update({"kind": item["kind"], "isl": len(item["prompt_ids"]), "osl": item["max_tokens"],
                        "late_s": rec["t_send"] - t0 - item["at"]})
            return rec

        return list(await asyncio.gather(*(one(i) for i in items)))


def analyze(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    out: dict = {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
                 "error_samples": sorted({r["error"] for r in records if r["error"]})[:5]}
    ttft = lambda rs: [(r["times"][0] - r["t_send"]) * 1e3 for r in rs]  # noqa: E731
    gaps_of = lambda rs: [(b - a) * 1e3 for r in rs for a, b in zip(r["times"], r["times"][1:])]  # noqa: E731
    for name, rs in (("", ok), ("short_", [r for r in ok if r["kind"] == "short"]),
                     ("long_", [r for r in ok if r["kind"] == "long"])):
        t = ttft(rs)
        out[f"{name}ttft_p50_ms"], out[f"{name}ttft_p99_ms"] = pct(t, 50), pct(t, 99)
    gaps = gaps_of(ok)
    out["itl_p50_ms"], out["itl_p99_ms"] = pct(gaps, 50), pct(gaps, 99)
    out["itl_p999_ms"], out["itl_max_ms"] = pct(gaps, 99.9), max(gaps, default=None)
    out["gaps_over_1s"] = sum(1 for g in gaps if g > 1000)
    short_gaps = gaps_of([r for r in ok if r["kind"] == "short"])
    out["short_itl_p99_ms"] = pct(short_gaps, 99)
    mean_itl = [(r["times"][-1] - r["times"][0]) * 1e3 / (r["completion_tokens"] - 1)
                for r in ok if r["completion_tokens"] > 1]
    out["req_itl_p50_ms"], out["req_itl_p99_ms"] = pct(mean_itl, 50), pct(mean_itl, 99)
    t0 = min((r["t_send"] for r in records), default=0)
    t1 = max((r["t_end"] for r in ok), default=t0)
    tokens = sum(r["completion_tokens"] for r in ok)
    out.update({"output_tokens": tokens, "makespan_s": t1 - t0, "output_tok_s": tokens / (t1 - t0) if t1 > t0 else None,
                "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
                "loadgen_late_s_max": max((r["late_s"] for r in records), default=None)})
    out["request_table_columns"] = ["t_send_s", "kind", "isl", "osl", "ttft_ms", "mean_itl_ms", "max_gap_ms", "error"]
    out["request_table"] = [
        [round(r["t_send"] - t0, 3), r["kind"], r["isl"], r["osl"],
         round((r["times"][0] - r["t_send"]) * 1e3, 1) if r["times"] else None,
         round((r["times"][-1] - r["times"][0]) * 1e3 / max(1, len(r["times"]) - 1), 1) if r["times"] else None,
         round(max(((b - a) * 1e3 for a, b in zip(r["times"], r["times"][1:])), default=0), 1), r["error"]]
        for r in sorted(records, key=lambda r: r["t_send"])]
    return out


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process and its live descendants (vLLM's engine core and
    worker processes are children of the turbine.vllm process)."""
    import psutil
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return proc_cpu_s(pid)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class QuietWatch:
    """Samples, while a measurement runs, whether a pytest process appeared (wait_quiet only
    checks before it starts) and the 1-minute load average."""

    def __init__(self, every_s: float = 2.0):
        self.every_s, self.pytest_seen_s, self.loadavg = every_s, 0.0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every_s):
            r = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True)
            if any(is_pytest(int(p)) for p in r.stdout.split() if p.strip() and int(p) != os.getpid()):
                self.pytest_seen_s += self.every_s
            self.loadavg.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        return {"pytest_seen_s": self.pytest_seen_s, "loadavg1_max": max(self.loadavg, default=None),
                "loadavg1_median": median(self.loadavg)}


# --------------------------------------------------------------------------- stacks
def frontend_argv(port: int, *extra: str) -> list[str]:
    return ["-m", "turbine.frontend", "--http-port", str(port), "--router-mode", "round-robin", *extra]


def ready_check(st: Stack, decode: int, prefill: int, url: str | None = None):
    def ready():
        status, body = http_get_json(f"{url or st.base_url}/health")
        return (status == 200 and isinstance(body, dict) and (body.get("models") or {}).get(SERVED) == decode
                and (body.get("prefill_workers") or {}).get(SERVED, 0) == prefill)
    return ready


def mocker_base(a) -> list[str]:
    return ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED, "--speedup-ratio", str(a.speedup),
            "--profile", str(a.profile), "--block-size", str(a.block_size), "--num-gpu-blocks", str(a.num_gpu_blocks),
            "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--max-model-len", str(a.max_model_len), "--kv-transfer-bandwidth", str(a.kv_transfer_bandwidth),
            *a.mocker_args.split()]


def vllm_base(a) -> list[str]:
    return ["-m", "turbine.vllm", "--model", a.model, "--served-model-name", SERVED, "--enforce-eager",
            "--max-model-len", str(a.max_model_len), *a.engine_args.split()]


def cpu_bind_env(a, index: int) -> dict[str, str]:
    """Where a vLLM CPU engine runs its OpenMP threads (the same policy for every setup).
    per-worker: the i-th worker's OpenMP on core i (VLLM_CPU_OMP_THREADS_BIND=i), as
                `turbine serve --disagg` does (the default).  Before Turbine restored the binding
                that vLLM's NIXL worker overrides (turbine/vllm/nixl_cpu.py), this put both
                engines' model threads on the last core and the pair crawled.
    reserve1:   VLLM_CPU_NUM_OF_RESERVED_CPU=1: what vLLM does by itself for one worker on 2
                cores (OpenMP on core 0); with two workers both compute on core 0.
    default:    vLLM's own choice.  With a KV connector vLLM reserves 2 cores (scheduler + NIXL);
                on a 2-core host that leaves none, so it binds 2 OpenMP threads to both cores beside
                its own busy scheduler and worker processes: decode steps of ~1.8 s instead of ~40 ms."""
    if a.cpu_bind == "reserve1":
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    if a.cpu_bind == "per-worker":
        return {"VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))}
    return {}


def start_setup(a, setup: dict, run_dir: Path, tag: str) -> Stack:
    """setup: {"kind": "agg"|"disagg", "workers"|"prefill"+"decode": counts}.  Mocker: one
    process per role with --num-workers; vLLM: one process per worker."""
    st = Stack(setup["name"], run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    plane = setup.get("plane")  # --request-planes: every process of the stack on it
    plane_env = {} if plane is None else {"TURBINE_REQUEST_PLANE": plane}
    if plane == "nats":
        plane_env["TURBINE_NATS_SERVER"] = start_nats(st)
    st.discovery_dir = disc
    st.worker_ports = {}
    roles = ([("agg", setup["workers"], [])] if setup["kind"] == "agg" else
             [("prefill", setup["prefill"], ["--disaggregation-mode", "prefill"]),
              ("decode", setup["decode"], ["--disaggregation-mode", "decode"])])
    st.argv = {}
    st.workers_started = []  # (the i-th worker's cores: cpu_bind_env)
    for role, count, flags in roles:
        if a.part == "mocker":
            port = free_port()
            argv = [*mocker_base(a), "--num-workers", str(count), *flags, "--system-port", str(port)]
            st.spawn(role, [a.python, *argv], turbine_env(disc, **plane_env))
            st.worker_ports[role] = [port]
            st.argv[role] = argv
        else:
            conn = ["--connector", "nixl"] if flags else []
            st.worker_ports[role] = []
            for k in range(count):
                port = free_port()
                argv = [*vllm_base(a), *flags, *conn, "--system-port", str(port)]
                env = {"VLLM_CPU_KVCACHE_SPACE": a.kvcache_space, **cpu_bind_env(a, len(st.workers_started)),
                       **plane_env}
                st.workers_started.append(role)
                st.spawn(f"{role}{k}", [a.python, *argv], turbine_env(disc, **env))
                st.env = {**getattr(st, "env", {}), f"{role}{k}": env}
                st.worker_ports[role].append(port)
                st.argv[f"{role}{k}"] = argv
    decode = setup["workers"] if setup["kind"] == "agg" else setup["decode"]
    prefill = 0 if setup["kind"] == "agg" else setup["prefill"]
    fe = frontend_argv(st.port, *setup.get("frontend_args", []), *a.frontend_args.split())
    st.argv["frontend"] = fe
    st.spawn("frontend", [a.python, *fe], turbine_env(disc, **plane_env))
    st.second_url = None
    if setup.get("second_frontend_args") is not None:  # crossover: a second frontend on the same workers
        st.second_port = free_port()
        fe2 = frontend_argv(st.second_port, *setup["second_frontend_args"])
        st.argv["frontend_local"] = fe2
        st.spawn("frontend_local", [a.python, *fe2], turbine_env(disc, **plane_env))
        st.second_url = f"http://127.0.0.1:{st.second_port}"
    try:
        st.wait_ready(ready_check(st, decode, prefill), a.startup_timeout)
        if st.second_url:
            st.wait_ready(ready_check(st, decode, prefill, st.second_url), 60)
        st.sanity_check(SERVED)
    except BaseException:
        log(st.logs_tail(20))
        st.stop()
        raise
    return st


def prefill_counts(url: str) -> dict:
    out = {}
    for name, labels, v in scrape(f"{url}/metrics"):
        if name == "turbine_frontend_prefills_total":
            out[labels.get("where", "?")] = out.get(labels.get("where", "?"), 0) + v
    return out


def kv_sources(st: Stack) -> dict:
    """vLLM workers: prompt tokens by source (local_compute, external_kv_transfer, local_cache_hit)."""
    out = {}
    for role, ports in st.worker_ports.items():
        for k, port in enumerate(ports):
            for name, labels, v in scrape(f"http://127.0.0.1:{port}/metrics"):
                if name == "vllm:prompt_tokens_by_source_total":
                    key = f"{role}{k}"
                    out.setdefault(key, {})[labels.get("source", "?")] = out.get(key, {}).get(labels.get("source", "?"), 0) + v
    return out


def diff(after: dict, before: dict) -> dict:
    if all(not isinstance(v, dict) for v in after.values()):
        return {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: diff(v, before.get(k, {})) for k, v in after.items()}


# --------------------------------------------------------------------------- mocker / vllm parts
def parse_pairs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        n, p, d = (int(x) for x in item.split(":"))
        out.append((n, p, d))
    return out


def setups_for(a) -> list[list[dict]]:
    """Groups of setups compared with each other: [agg N, disagg P+D] per pair (--request-planes: [disagg P+D
    on each plane])."""
    groups = []
    for n, p, d in a.pairs:
        if a.request_planes:
            groups.append([{"name": f"{p}P{d}D-{plane}", "kind": "disagg", "prefill": p, "decode": d,
                            "group": f"{n} workers", "plane": plane} for plane in a.request_planes])
            continue
        groups.append([{"name": f"agg{n}", "kind": "agg", "workers": n, "group": f"{n} workers"},
                       {"name": f"{p}P{d}D", "kind": "disagg", "prefill": p, "decode": d, "group": f"{n} workers"}])
    return groups


def run_load(a, setup: dict, rate: float, items: list[dict], rep: int, run_dir: Path) -> dict:
    tag = f"r{rep}_{setup['name']}_rate{rate:g}"
    wait_quiet()
    st = start_setup(a, setup, run_dir, tag)
    try:
        procs = {p.name.split()[-1]: p.popen.pid for p in st.procs}
        cpu0 = {k: tree_cpu_s(pid) for k, pid in procs.items()}
        pre0, src0 = prefill_counts(st.base_url), kv_sources(st)
        load0 = os.getloadavg()
        w0 = time.monotonic()
        with QuietWatch() as quiet:
            records = asyncio.run(drive(st.base_url, items))
        w1 = time.monotonic()
        cpu1 = {k: tree_cpu_s(pid) for k, pid in procs.items()}
        prefills = diff(prefill_counts(st.base_url), pre0)
        sources = diff(kv_sources(st), src0)
        died = [p.name for p in st.procs if not p.alive()]
    finally:
        st.stop()
    m = analyze(records)
    long_n = sum(1 for r in records if r["isl"] >= setup.get("threshold", a.max_local_prefill_length))
    remote = prefills.get("remote", 0)
    m.update({"repeat": rep, "setup": setup["name"], "kind": setup["kind"], "group": setup["group"], "rate": rate,
              "wall_s": w1 - w0, "prefills": prefills, "remote_prefills": remote if setup["kind"] == "disagg" else None,
              "long_prefilled_locally": (long_n - remote - prefills.get("local_fallback", 0))
              if setup["kind"] == "disagg" else None,
              "prompt_tokens_by_source": sources, "loadavg_before": load0, "quiet": quiet.record(),
              "cpu_util": {k: round((cpu1[k] - cpu0[k]) / (w1 - w0), 3) if cpu0.get(k) is not None and cpu1.get(k) is not None
                           else None for k in procs},
              "died": died, "argv": st.argv, "worker_env": getattr(st, "env", {}), "logs": [str(p.log_path) for p in st.procs]})
    log(f"{tag}: {m['ok']}/{m['requests']} ok, TTFT p50/p99 {fmt(m['ttft_p50_ms'])}/{fmt(m['ttft_p99_ms'])} ms "
        f"(short {fmt(m['short_ttft_p50_ms'])}/{fmt(m['short_ttft_p99_ms'])}, long {fmt(m['long_ttft_p50_ms'])}/"
        f"{fmt(m['long_ttft_p99_ms'])}), ITL p50/p99 {fmt(m['itl_p50_ms'])}/{fmt(m['itl_p99_ms'])} ms, max gap "
        f"{fmt(m['itl_max_ms'])} ms, {m['gaps_over_1s']} gaps > 1 s, {fmt(m['output_tok_s'])} tok/s, prefills {prefills}, "
        f"long local {m['long_prefilled_locally']}, cpu {m['cpu_util']}, quiet {m['quiet']}, {m['wall_s']:.0f}s")
    if died or m["errors"]:
        log(f"{tag}: errors {m['error_samples']} died {died}")
        for p in st.procs:
            log(f"--- {p.log_path} ---\n{tail(p.log_path, 15)}")
    return m


KEYS = ("ttft_p50_ms", "ttft_p99_ms", "short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
        "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "short_itl_p99_ms", "req_itl_p50_ms", "req_itl_p99_ms", "gaps_over_1s",
        "output_tok_s", "remote_prefills", "long_prefilled_locally")


def summarize_load(runs: list[dict]) -> list[dict]:
    rows = []
    for key in dict.fromkeys((r["group"], r["rate"], r["setup"]) for r in runs):
        rs = [r for r in runs if (r["group"], r["rate"], r["setup"]) == key]
        row = {"group": key[0], "rate": key[1], "setup": key[2], "runs": len(rs), "errors": sum(r["errors"] for r in rs)}
        row.update({k: median([r[k] for r in rs if r[k] is not None]) for k in KEYS})
        rows.append(row)
    return rows


def markdown_load(rows: list[dict], runs: list[dict]) -> str:
    lines = ["| workers | rate (req/s) | setup | TTFT p50 / p99 (ms) | short TTFT p50 / p99 | long TTFT p50 / p99 "
             "| ITL p50 / p99 (ms) | short-stream ITL p99 | max gap (ms) | gaps > 1 s | per-request ITL p50 / p99 "
             "| output tok/s | remote prefills | long prompts prefilled on decode | runs (errors) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        lines.append(
            f"| {s['group']} | {s['rate']:g} | {s['setup']} | {fmt(s['ttft_p50_ms'], 0)} / {fmt(s['ttft_p99_ms'], 0)} "
            f"| {fmt(s['short_ttft_p50_ms'], 0)} / {fmt(s['short_ttft_p99_ms'], 0)} "
            f"| {fmt(s['long_ttft_p50_ms'], 0)} / {fmt(s['long_ttft_p99_ms'], 0)} "
            f"| {fmt(s['itl_p50_ms'])} / {fmt(s['itl_p99_ms'])} | {fmt(s['short_itl_p99_ms'])} | {fmt(s['itl_max_ms'], 0)} "
            f"| {fmt(s['gaps_over_1s'], 0)} | {fmt(s['req_itl_p50_ms'])} / {fmt(s['req_itl_p99_ms'])} "
            f"| {fmt(s['output_tok_s'])} | {fmt(s['remote_prefills'], 0)} | {fmt(s['long_prefilled_locally'], 0)} "
            f"| {s['runs']} ({s['errors']}) |")
    lines += ["", "Every run:", "", "| repeat | workers | rate | setup | ok / sent | TTFT p50 / p99 | ITL p50 / p99 | max gap "
              "| tok/s | prefills (frontend) | CPU per process (cores) | pytest seen (s) / load1 max |",
              "|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in runs:
        lines.append(f"| {r['repeat']} | {r['group']} | {r['rate']:g} | {r['setup']} | {r['ok']} / {r['requests']} "
                     f"| {fmt(r['ttft_p50_ms'], 0)} / {fmt(r['ttft_p99_ms'], 0)} | {fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])} "
                     f"| {fmt(r['itl_max_ms'], 0)} | {fmt(r['output_tok_s'])} | {json.dumps(r['prefills'])} "
                     f"| {json.dumps(r['cpu_util'])} | {r['quiet']['pytest_seen_s']:.0f} / {fmt(r['quiet']['loadavg1_max'], 2)} |")
    return "\n".join(lines)


def part_load(a, run_dir: Path, checkpoint=lambda result, table: None) -> tuple[dict, str, int]:
    groups = setups_for(a)
    rates = a.rates
    workloads = {}
    runs, failures = [], 0
    for rep in range(a.repeats):
        for gi, group in enumerate(groups):
            n_workers = group[0].get("workers") or group[0]["prefill"] + group[0]["decode"]
            for rate in rates:
                # Rates are per 2 workers: a fleet of N gets N/2 times the rate (the same load per worker).
                eff = rate * n_workers / 2
                if eff not in workloads:
                    workloads[eff] = make_workload(a, eff)
                order = group if rep % 2 == 0 else group[::-1]
                for setup in order:
                    try:
                        runs.append(run_load(a, setup, eff, workloads[eff], rep, run_dir))
                    except (RuntimeError, OSError) as e:
                        failures += 1
                        log(f"r{rep} {setup['name']} rate {eff:g}: FAILED: {e}")
                    rows = summarize_load(runs)  # saved after every run: a killed sitting keeps its runs
                    checkpoint({"summary": rows, "runs": runs, "partial": True}, markdown_load(rows, runs))
    rows = summarize_load(runs)
    failures += sum(1 for r in runs if r["errors"] or r["died"])
    return ({"summary": rows, "runs": runs, "workloads": {str(k): describe(v, k) for k, v in workloads.items()}},
            markdown_load(rows, runs), failures)


# --------------------------------------------------------------------------- crossover
async def one_request(url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        return await stream_one(client, url, prompt_ids, max_tokens)


def part_crossover(a, run_dir: Path) -> tuple[dict, str, int]:
    rng = random.Random(a.seed)
    prompt = lambda n: [rng.randrange(1000, 49152) for _ in range(n)]  # noqa: E731  (unique: no cache hits)
    setup = {"name": "1P1D", "kind": "disagg", "prefill": 1, "decode": 1, "frontend_args": ["--max-local-prefill-length", "0"],
             "second_frontend_args": ["--max-local-prefill-length", str(HUGE)]}
    wait_quiet()
    st = start_setup(a, setup, run_dir, "crossover")
    urls = {"remote": st.base_url, "local": st.second_url}
    samples: list[dict] = []
    failures = 0
    try:
        for mode, url in urls.items():  # warm both paths (the first NIXL hand-off sets up the peer)
            for n in (64, 512, 64):
                r = asyncio.run(one_request(url, prompt(n), a.crossover_max_tokens))
                log(f"warmup {mode} {n} tokens: TTFT {fmt((r['times'][0] - r['t_send']) * 1e3 if r['times'] else None)} ms "
                    f"{r['error'] or ''}")
        pre0, src0 = prefill_counts(st.base_url), kv_sources(st)
        load0 = os.getloadavg()
        quiet = QuietWatch()
        quiet.__enter__()
        for rep in range(a.repeats):
            for li, n in enumerate(a.lengths):
                order = ["remote", "local"] if (rep + li) % 2 == 0 else ["local", "remote"]
                for mode in order:
                    wait_quiet()
                    time.sleep(a.crossover_gap_s)
                    r = asyncio.run(one_request(urls[mode], prompt(n), a.crossover_max_tokens))
                    ttft = (r["times"][0] - r["t_send"]) * 1e3 if r["times"] else None
                    itl = ((r["times"][-1] - r["times"][0]) * 1e3 / (r["completion_tokens"] - 1)
                           if r["error"] is None and r["completion_tokens"] > 1 else None)
                    samples.append({"repeat": rep, "length": n, "mode": mode, "ttft_ms": ttft, "itl_ms": itl,
                                    "cached_tokens": r["cached_tokens"], "error": r["error"]})
                    if r["error"]:
                        failures += 1
                    log(f"r{rep} {n:>5} tokens {mode:>6}: TTFT {fmt(ttft)} ms, ITL {fmt(itl)} ms {r['error'] or ''}")
        quiet.__exit__()
        prefills = diff(prefill_counts(st.base_url), pre0)
        sources = diff(kv_sources(st), src0)
        argv, logs = {**st.argv, "worker_env": getattr(st, "env", {})}, [str(p.log_path) for p in st.procs]
        if st.any_dead():
            failures += 1
            log(st.logs_tail())
    finally:
        st.stop()
    analysis, table = analyze_crossover(samples, a.lengths, a.tolerance, a.stall_ms)
    table += (f"\nFrontend prefills during the measurement: {json.dumps(prefills)}; prompt tokens by source: "
              f"{json.dumps(sources)}")
    return ({**analysis, "samples": samples, "prefills": prefills, "prompt_tokens_by_source": sources, "loadavg_before": load0,
             "quiet": quiet.record(), "argv": argv, "logs": logs},
            table, failures)


def analyze_crossover(samples: list[dict], lengths: list[int], tolerance: float, stall_ms: float) -> tuple[dict, str]:
    """Medians per length, and the suggested --max-local-prefill-length: the shortest length from
    which on (at every longer length too, not a lucky single one) the hand-off costs the request at
    most `tolerance` more TTFT than prefilling on the decode worker, while prefilling there would
    stall that worker's other streams for at least `stall_ms` (its local prefill time)."""
    rows = []
    for n in lengths:
        row = {"length": n}
        for mode in ("remote", "local"):
            xs = [s for s in samples if s["length"] == n and s["mode"] == mode and s["ttft_ms"] is not None]
            row[f"{mode}_ttft_ms"] = median([s["ttft_ms"] for s in xs])
            row[f"{mode}_ttft_all"] = [round(s["ttft_ms"], 1) for s in xs]
            row[f"{mode}_itl_ms"] = median([s["itl_ms"] for s in xs if s["itl_ms"] is not None])
        row["remote_over_local"] = ratio(row["remote_ttft_ms"], row["local_ttft_ms"])
        row["remote_minus_local_ms"] = (row["remote_ttft_ms"] - row["local_ttft_ms"]
                                        if row["remote_ttft_ms"] is not None and row["local_ttft_ms"] is not None else None)
        row["hand_off_pays"] = (row["remote_over_local"] is not None and row["remote_over_local"] <= 1 + tolerance
                                and row["local_ttft_ms"] >= stall_ms)
        rows.append(row)
    suggested = next((r["length"] for i, r in enumerate(rows) if all(x["hand_off_pays"] for x in rows[i:])), None)
    lines = [f"| prompt tokens | TTFT remote prefill (ms) | TTFT local prefill (ms) | **remote / local** | remote − local (ms) "
             f"| ITL remote / local (ms) | samples remote ; local |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['length']} | {fmt(r['remote_ttft_ms'])} | {fmt(r['local_ttft_ms'])} | **{fmt(r['remote_over_local'], 2)}** "
                     f"| {fmt(r['remote_minus_local_ms'])} | {fmt(r['remote_itl_ms'])} / {fmt(r['local_itl_ms'])} "
                     f"| {', '.join(map(str, r['remote_ttft_all']))} ; {', '.join(map(str, r['local_ttft_all']))} |")
    lines += ["", f"Suggested --max-local-prefill-length: {suggested} (from there on the hand-off adds at most "
                  f"{tolerance:.0%} to TTFT and a local prefill would stall the decode worker >= {stall_ms:g} ms)."]
    return ({"summary": rows, "suggested_max_local_prefill_length": suggested, "tolerance": tolerance,
             "stall_ms": stall_ms}, "\n".join(lines))


def reanalyze(path: str, tolerance: float, stall_ms: float) -> int:
    """Recompute a saved crossover result's summary under another rule (its samples stay)."""
    data = json.loads(Path(path).read_text())
    lengths = sorted({s["length"] for s in data["samples"]})
    analysis, table = analyze_crossover(data["samples"], lengths, tolerance, stall_ms)
    for stale in ("crossover_length", "within_tolerance"):
        data.pop(stale, None)
    data.update(analysis, markdown=table, reanalyzed_by=[sys.executable, *sys.argv])
    Path(path).write_text(dump_json(data) + "\n")
    print(table)
    return 0


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`)")
    p.add_argument("--repeats", type=int, default=None, help="default: 2 (mocker, vllm), 3 (crossover)")
    p.add_argument("--seed", type=int, default=5)
    g = p.add_argument_group("setups (mocker, vllm)")
    g.add_argument("--pairs", type=parse_pairs, default=None,
                   help="N:P:D comma-separated: N aggregated workers vs P prefill + D decode workers "
                        "(default: mocker 2:1:1,4:2:2; vllm 2:1:1)")
    g.add_argument("--max-local-prefill-length", type=int, default=256,
                   help="the frontend's default, passed on only to count long prompts prefilled on the decode "
                        "worker; change the frontend with --frontend-args")
    g.add_argument("--frontend-args", default="", help="extra turbine.frontend flags (every frontend of mocker/vllm)")
    g.add_argument("--request-planes", default=None,
                   help="comma-separated request planes (tcp,nats): compare the disaggregated setup on each instead "
                        "of aggregated vs disaggregated")
    g = p.add_argument_group("load (mocker, vllm)")
    g.add_argument("--rates", default=None,
                   help="comma-separated requests/s offered to 2 workers (a 4-worker pair gets twice as much); "
                        "default: mocker 0.5,0.8, vllm 0.12")
    g.add_argument("--requests", type=int, default=None, help="default: mocker 100, vllm 16")
    g.add_argument("--short-frac", type=float, default=0.7)
    g.add_argument("--short-in", type=span, default=span("100-200"), help="prompt tokens of short requests, LO-HI")
    g.add_argument("--short-out", type=span, default=span("100-200"))
    g.add_argument("--long-in", type=span, default=span("1500-3000"))
    g.add_argument("--long-out", type=span, default=span("16-48"))
    g = p.add_argument_group("engine (both)")
    g.add_argument("--max-model-len", type=int, default=4096)
    g = p.add_argument_group("mocker")
    g.add_argument("--profile", default=str(PROFILE), help="calibrated timing profile")
    g.add_argument("--speedup", type=float, default=1.0)
    g.add_argument("--kv-transfer-bandwidth", type=float, default=25.0, help="GB/s")
    g.add_argument("--block-size", type=int, default=128, help="the vLLM CPU worker's")
    g.add_argument("--num-gpu-blocks", type=int, default=728, help="the vLLM CPU worker's with VLLM_CPU_KVCACHE_SPACE=2")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--mocker-args", default="", help="extra turbine.mocker flags")
    g = p.add_argument_group("vllm, crossover")
    g.add_argument("--kvcache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB) per worker")
    g.add_argument("--engine-args", default="", help="extra turbine.vllm flags (every worker)")
    g.add_argument("--cpu-bind", choices=("per-worker", "reserve1", "default"), default="per-worker",
                   help="vLLM OpenMP binding of every worker: per-worker (worker i on core i, as turbine serve "
                        "--disagg; the default), reserve1 (VLLM_CPU_NUM_OF_RESERVED_CPU=1), default (vLLM's "
                        "own: ~45x slower decode for KV-connector workers on 2 cores); see cpu_bind_env")
    g = p.add_argument_group("crossover")
    g.add_argument("--lengths", default="32,64,128,256,512,1024,2048,3072")
    g.add_argument("--crossover-max-tokens", type=int, default=8)
    g.add_argument("--crossover-gap-s", type=float, default=0.5, help="idle time before each request")
    g.add_argument("--tolerance", type=float, default=0.25,
                   help="the hand-off may add this fraction to a prompt's TTFT where it pays (see --stall-ms)")
    g.add_argument("--stall-ms", type=float, default=1000,
                   help="a local prefill at least this long (it stalls the decode worker's streams) is worth "
                        "handing off")
    g.add_argument("--reanalyze", metavar="JSON", default=None,
                   help="recompute a saved crossover result's summary with --tolerance/--stall-ms, run nothing")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help=f"default benchmarks/results/disagg/disagg-PART-{today}.json")
    p._today = today
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.reanalyze:
        return reanalyze(a.reanalyze, a.tolerance, a.stall_ms)
    mock = a.part == "mocker"
    a.repeats = a.repeats or (3 if a.part == "crossover" else 2)
    a.pairs = a.pairs or parse_pairs("2:1:1,4:2:2" if mock else "2:1:1")
    a.rates = [float(x) for x in (a.rates or ("0.5,0.8" if mock else "0.12")).split(",")]
    a.requests = a.requests or (100 if mock else 16)
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.request_planes = [x for x in (a.request_planes or "").split(",") if x]
    if any(x not in ("tcp", "nats") for x in a.request_planes):
        parser.error(f"--request-planes {','.join(a.request_planes)}: choose from tcp, nats")
    a.model = a.model or default_model(a.python)
    a.out = a.out or str(REPO_ROOT / "benchmarks" / "results" / "disagg" / f"disagg-{a.part}-{parser._today}.json")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-disagg-{a.part}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"part {a.part}; logs under {run_dir}")
    started = time.time()
    waited = wait_quiet()
    load_start = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "turbine"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.strip()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: (v if not isinstance(v, tuple) else list(v)) for k, v in vars(a).items()}
    vers = versions(a.python) if not mock else None

    def write(result: dict, table: str) -> None:
        out.write_text(dump_json({
            "benchmark": f"disagg_{a.part}", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv], "commit": commit,
            "turbine_tree_changes": dirty.splitlines(), "versions": vers,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": load_start,
                     "loadavg_end": os.getloadavg(), "waited_for_pytest_s": waited},
            "config": cfg, "work_dir": str(run_dir), **result, "markdown": table}) + "\n")

    exit_on_sigterm()
    if a.part == "crossover":
        result, table, failures = part_crossover(a, run_dir)
    else:
        result, table, failures = part_load(a, run_dir, write)
    print(table)
    write(result, table)
    log(f"wrote {out} ({time.time() - started:.0f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

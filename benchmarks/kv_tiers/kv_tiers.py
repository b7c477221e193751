#!/usr/bin/env python3
r"""Multi-tier KV cache (issue #18) on a real vLLM CPU worker: returning conversations' TTFT and the
run's throughput with no tiers vs `--connector kvbm` tiers, same run, alternating order, repeats.

Each run starts, on a private file-discovery folder (benchmarks/lib/stack.py):
  python -m turbine.vllm --model SmolLM2 --dtype float32 --enforce-eager --max-model-len L
        --num-gpu-blocks-override N [mode's flags]
        (VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=--omp-bind: the same core(s) in every mode)
  python -m turbine.frontend --http-port P
waits for the model, sends one sanity request, drives the workload from this process, scrapes the
worker's /metrics (turbine_kvbm_* and vLLM's prefix-cache counters) and stops both. Every run
starts with empty caches and an empty disk directory of its own.

Modes (--modes, each a worker configuration):
  none            no connector: the engine's own prefix cache only
  host            --connector kvbm --kv-host-cache-gb --host-gb (sized to hold the whole working set)
  host+disk       --connector kvbm --kv-host-cache-gb --small-host-gb --kv-disk-cache-gb --disk-gb
                  --kv-disk-cache-dir RUN/disk-TAG (the host tier holds a fraction of the working set)
  host+disk-minN  host+disk with --kv-disk-min-uses N (the disk tier's frequency filter)
  small-host      --kv-host-cache-gb --small-host-gb alone (what host+disk adds its disk to)
Two-worker modes (what the shared tier is for: a conversation that returns to another worker). Two
workers, each pinned to a core of its own (--omp-bind-2w, default core 0 and core 1), one frontend
routing round-robin; with an odd --conversations count and the turn-major order, every returning turn
lands on the other worker than the conversation's previous turn (turn 3 is back on turn 1's worker):
  none2           no connector on either worker
  host2           each worker its own --kv-host-cache-gb --host-gb (private: turn 2 finds nothing)
  shared2         each worker only --kv-shared-cache-gb --shared-gb on one directory (RUN/shared-TAG)
The two-worker rows compare with each other (same run, same cores, same routing); against the
one-worker rows only roughly: requests are still one at a time, each computed on one core, but two
engines (their schedulers) and the frontend share the host's 2 cores.

Workload (synthetic multi-turn chat as token ids through /v1/completions, so prompts are exact):
--conversations conversations, each with its own --context-tokens tokens of history (random ids,
seeded per conversation: no two conversations share a prefix); turn t's prompt is the context plus,
for every earlier turn, --user-tokens user tokens and --answer-tokens tokens standing for the
answer (fixed ids, not the model's output, so every turn's prompt extends the previous one), plus
this turn's user tokens. --output-tokens tokens are generated (ignore_eos). Turn-major order: turn 1
of every conversation, then turn 2 of every conversation, ... one request at a time (closed loop),
so between two turns of a conversation every other conversation ran: with an engine cache of N
blocks holding a few conversations, a returning conversation's history has always left the engine.

Reported per mode (medians over repeats): TTFT p50/p99 of returning turns (turn >= 2) and of first
turns, run throughput (requests/s and prompt tokens/s over the whole run), cache hit rate of
returning turns (usage cached_tokens / prompt tokens), disk bytes written and tier hits (the
worker's turbine_kvbm_* counters); ratios of `none` over each mode's returning-turn TTFT p50. Per run, the
first and the returning turns' mean TTFT split by the servers' histograms (`*_phases_ms`: the frontend's TTFT,
vLLM's TTFT, its queue wait, scheduled to first token; the connector's loads and saves in the engine's steps).

  .venv/bin/python -m benchmarks.kv_tiers.kv_tiers --repeats 2 --lock /tmp/turbine-engine.lock --out benchmarks/results/kv_tiers/kv_tiers-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.load import stream_request
from benchmarks.lib.metrics import scrape
from benchmarks.lib.paths import REPO_ROOT, default_model
from benchmarks.lib.proc import exit_on_sigterm, http_get_json, log
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.stack import Stack, turbine_env
from benchmarks.lib.stats import fmt, median, pct, ratio
from turbine.runtime.ports import free_port


SERVED = "smollm2-135m-instruct"
BASE_MODES = ("none", "host", "host+disk", "small-host")
TWO_WORKER_MODES = ("none2", "host2", "shared2")


def mode_workers(mode: str) -> int:
    return 2 if mode in TWO_WORKER_MODES else 1


def mode_flags(a, mode: str, disk_dir: Path, shared_dir: Path | None = None) -> list[str]:
    if mode in ("none", "none2"):
        return []
    if mode == "host2":
        return ["--connector", "kvbm", "--kv-host-cache-gb", str(a.host_gb)]
    if mode == "shared2":
        return ["--connector", "kvbm", "--kv-shared-cache-gb", str(a.shared_gb), "--kv-shared-cache-dir",
                str(shared_dir or disk_dir)]
    if mode == "host":
        return ["--connector", "kvbm", "--kv-host-cache-gb", str(a.host_gb)]
    if mode == "small-host":
        return ["--connector", "kvbm", "--kv-host-cache-gb", str(a.small_host_gb)]
    if mode == "host+disk" or mode.startswith("host+disk-min"):
        flags = ["--connector", "kvbm", "--kv-host-cache-gb", str(a.small_host_gb), "--kv-disk-cache-gb",
                 str(a.disk_gb), "--kv-disk-cache-dir", str(disk_dir)]
        if mode != "host+disk":
            flags += ["--kv-disk-min-uses", mode.removeprefix("host+disk-min")]
        return flags
    raise SystemExit(f"--modes: unknown mode {mode!r} (none, host, small-host, host+disk, host+disk-minN, "
                     f"none2, host2, shared2)")


# --------------------------------------------------------------------------- workload
def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of every layer for one token, from the model's config.json (to size the tiers against)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    size = 4 if "32" in dtype else 2
    return cfg["num_hidden_layers"] * heads * head_dim * 2 * size


def conversations(a) -> list[list[dict]]:
    """Per turn, the requests of every conversation in order: {conv, turn, prompt_ids}."""
    def ids(seed: int, n: int) -> list[int]:
        g = random.Random(seed)
        return [g.randrange(1000, a.vocab) for _ in range(n)]

    turns: list[list[dict]] = [[] for _ in range(a.turns)]
    for c in range(a.conversations):
        history = ids(a.seed * 1_000_003 + c, a.context_tokens)
        for t in range(a.turns):
            user = ids(a.seed * 1_000_003 + c * 1009 + t * 7 + 1, a.user_tokens)
            prompt = history + user
            turns[t].append({"conv": c, "turn": t + 1, "prompt_ids": prompt})
            history = prompt + ids(a.seed * 1_000_003 + c * 1009 + t * 7 + 2, a.answer_tokens)
    return turns


async def drive(a, url: str, after_first_turn=None) -> list[dict]:
    import httpx
    records = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:
        for t, turn in enumerate(conversations(a)):
            if t == 1 and after_first_turn is not None:
                after_first_turn()
            for item in turn:
                body = {"model": a.served_model_name, "prompt": item["prompt_ids"], "max_tokens": a.output_tokens,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                rec = await stream_request(client, f"{url}/v1/completions", body, "completions")
                rec.pop("text", None)
                rec.update(conv=item["conv"], turn=item["turn"], prompt_len=len(item["prompt_ids"]))
                records.append(rec)
    return records


# --------------------------------------------------------------------------- one run
def worker_argv(a, port: int, flags: list[str]) -> list[str]:
    return ["-m", "turbine.vllm", "--model", a.model, "--served-model-name", a.served_model_name, "--dtype", a.dtype,
            "--enforce-eager", "--max-model-len", str(a.max_model_len), "--num-gpu-blocks-override",
            str(a.engine_blocks), "--system-port", str(port), *(["--block-size", str(a.block_size)] if a.block_size
                                                                 else []), *a.worker_args.split(), *flags]


def kv_counters(samples) -> dict:
    """turbine_kvbm_* and vLLM's prefix-cache counters, summed over other labels, keyed name{tier|source}."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name.endswith(("_created", "_bucket")):
            continue
        if name.startswith("turbine_kvbm_") or name.startswith(("vllm:prefix_cache", "vllm:external_prefix_cache",
                                                                "vllm:prompt_tokens_cached")):
            sub = labels.get("tier") or labels.get("source")
            key = f"{name}{{{sub}}}" if sub else name
            out[key] = out.get(key, 0.0) + value
    return out


# Where a turn's TTFT goes, by the servers' own histograms (sums and counts differenced around the first turns and
# around the returning ones: requests run one at a time): the frontend's TTFT from its arrival, vLLM's from its
# engine client's arrival, vLLM's wait to be scheduled, and scheduled to first token (the step that loads and
# computes the prompt). What the client sees beyond the frontend's TTFT is HTTP and the client itself.
PHASES = {"frontend_ttft": "turbine_frontend_time_to_first_token_seconds",
          "engine_ttft": "vllm:time_to_first_token_seconds",
          "engine_queue": "vllm:request_queue_time_seconds",
          "engine_prefill": "vllm:request_prefill_time_seconds"}
# ... and, per request, the connector's time in the engine's steps: loads before the forward pass, handing new blocks
# to the tiers after it (counters: divided by the requests vLLM counted).
STEP_PHASES = {"kvbm_step_load": "turbine_kvbm_step_load_seconds_total",
               "kvbm_step_save": "turbine_kvbm_step_save_seconds_total"}


def phase_sums(samples) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, _, value in samples:
        for phase, family in PHASES.items():
            if name in (f"{family}_sum", f"{family}_count"):
                key = phase + name[len(family):]
                out[key] = out.get(key, 0.0) + value
        for phase, family in STEP_PHASES.items():
            if name == family:
                out[f"{phase}_sum"] = out.get(f"{phase}_sum", 0.0) + value
    return out


def phase_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    requests = after.get("engine_ttft_count", 0.0) - before.get("engine_ttft_count", 0.0)
    for phase in [*PHASES, *STEP_PHASES]:
        n = after.get(f"{phase}_count", 0.0) - before.get(f"{phase}_count", 0.0) if phase in PHASES else requests
        out[phase] = 1000 * (after.get(f"{phase}_sum", 0.0) - before.get(f"{phase}_sum", 0.0)) / n if n else None
    return out


def analyze(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    def ttfts(sel):
        return [(r["t_first"] - r["t_send"]) * 1000 for r in sel]
    returning = [r for r in ok if r["turn"] >= 2]
    first = [r for r in ok if r["turn"] == 1]
    rt, ft = ttfts(returning), ttfts(first)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    ret_prompt = sum(r["prompt_tokens"] or 0 for r in returning)
    ret_cached = sum(r["cached_tokens"] or 0 for r in returning)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "error_samples": [r["error"] for r in records if r["error"]][:3],
        "returning_ttft_p50_ms": pct(rt, 50), "returning_ttft_p99_ms": pct(rt, 99),
        "returning_ttft_mean_ms": statistics.fmean(rt) if rt else None,
        "first_ttft_p50_ms": pct(ft, 50), "first_ttft_p99_ms": pct(ft, 99),
        "returning_hit_rate": ret_cached / ret_prompt if ret_prompt else None,
        "request_per_s": len(ok) / wall_s, "prompt_tok_s": prompt_tokens / wall_s, "wall_s": wall_s,
        "prompt_tokens_mean": statistics.fmean(r["prompt_len"] for r in records) if records else None,
        "per_turn_ttft_p50_ms": {t: pct(ttfts([r for r in ok if r["turn"] == t]), 50)
                                 for t in sorted({r["turn"] for r in ok})},
        "per_turn_hit_rate": {t: (sum(r["cached_tokens"] or 0 for r in ok if r["turn"] == t)
                                  / max(1, sum(r["prompt_tokens"] or 0 for r in ok if r["turn"] == t)))
                              for t in sorted({r["turn"] for r in ok})},
    }


def run_repeat(a, modes: list[str], rep: int, run_dir: Path) -> list[dict]:
    """One run of every mode (order reversed on odd repeats), holding --lock for the repeat
    (--lock-scope repeat) or for every repeat (all)."""
    order = modes if rep % 2 == 0 else list(reversed(modes))
    if not a.lock or a.lock_scope == "all":
        return [run_one(a, mode, rep, run_dir) for mode in order]
    with engine_lock(a.lock):
        return [run_one(a, mode, rep, run_dir) for mode in order]


@contextlib.contextmanager
def engine_lock(path: str):
    import fcntl
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # engine runs one at a time on a host shared with others
        yield


def py_spy(a, st: Stack, run_dir: Path, tag: str) -> list[subprocess.Popen]:
    """--py-spy: two recordings of the worker and its engine process while the workload runs (raw collapsed
    stacks, one line per thread): every thread's samples, idle ones included (where the engine's thread waits),
    and only the GIL holder's (--gil: which thread holds the GIL, for how much of the run)."""
    if not a.py_spy:
        return []
    pid = st.procs[0].popen.pid
    out = []
    for kind, extra in (("all", ["--idle"]), ("gil", ["--gil"])):
        out.append(subprocess.Popen([a.py_spy, "record", "--nonblocking", "--subprocesses", "--threads", *extra,
                                     "-r", "100", "-f", "raw", "-o", str(run_dir / f"pyspy-{tag}-{kind}.txt"),
                                     "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return out


def run_one(a, mode: str, rep: int, run_dir: Path) -> dict:
    tag = f"r{rep}_{mode}"
    wait_quiet()
    disk_dir, shared_dir = Path(a.disk_root or run_dir) / f"disk-{tag}", run_dir / f"shared-{tag}"
    st = Stack(mode, run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    n = mode_workers(mode)
    binds = [a.omp_bind] if n == 1 else a.omp_bind_2w.split("|")
    metrics_ports, argvs = [], []
    for i in range(n):
        metrics_ports.append(free_port())
        argv = worker_argv(a, metrics_ports[i], mode_flags(a, mode, disk_dir, shared_dir))
        argvs.append(argv)
        worker_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
        if binds[i] != "auto" and a.device == "cpu":
            # The same compute cores in every mode: left to itself, vLLM's CPU build reserves one more core when a
            # KV connector is configured, which on a 2-core host means 2 OpenMP threads with kvbm and 1 without.
            # Two workers: a core each.
            worker_env["VLLM_CPU_OMP_THREADS_BIND"] = binds[i]
        st.spawn("worker" if n == 1 else f"worker{i}", [a.python, *argv], turbine_env(disc, **worker_env))
    # Round-robin (the frontend's default, named here): with two workers a returning turn changes worker.
    st.spawn("frontend", [a.python, "-m", "turbine.frontend", "--http-port", str(st.port), "--router-mode",
                          "round-robin"], turbine_env(disc))

    def ready():
        status, body = http_get_json(f"{st.base_url}/health")
        return status == 200 and isinstance(body, dict) and (body.get("models") or {}).get(a.served_model_name) == n

    def counters() -> list[dict]:
        return [kv_counters(scrape(f"http://127.0.0.1:{port}/metrics")) for port in metrics_ports]

    def phases() -> dict[str, float]:
        samples = [s for port in metrics_ports for s in scrape(f"http://127.0.0.1:{port}/metrics")]
        return phase_sums(samples + scrape(f"{st.base_url}/metrics"))
    marks: list[dict[str, float]] = []
    try:
        st.wait_ready(ready, a.startup_timeout)
        st.sanity_check(a.served_model_name)
        before = counters()
        spies = py_spy(a, st, run_dir, tag) if mode != "none" else []
        marks.append(phases())
        t0 = time.monotonic()
        records = asyncio.run(drive(a, st.base_url, after_first_turn=lambda: marks.append(phases())))
        wall = time.monotonic() - t0
        marks.append(phases())
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(60)
        time.sleep(1.5)  # the connector's stats reach /metrics with the engine's next stats interval
        after = counters()
        died = [p.name for p in st.procs if not p.alive()]
    except BaseException:
        log(st.logs_tail(20))
        raise
    finally:
        st.stop()
    per_worker = [{k: v - b.get(k, 0.0) for k, v in af.items()} for af, b in zip(after, before)]
    summed: dict[str, float] = {}
    for c in per_worker:
        for k, v in c.items():
            summed[k] = summed.get(k, 0.0) + v
    shared_bytes = sum(f.stat().st_size for f in shared_dir.rglob("*.kvb")) if shared_dir.exists() else 0
    shutil.rmtree(shared_dir, ignore_errors=True)
    disk_bytes = sum(f.stat().st_size for f in disk_dir.rglob("*.kvb")) if disk_dir.exists() else 0
    shutil.rmtree(disk_dir, ignore_errors=True)
    m = analyze(records, wall)
    if len(marks) == 3:
        m["first_turn_phases_ms"] = phase_means_ms(marks[0], marks[1])
        m["returning_phases_ms"] = phase_means_ms(marks[1], marks[2])
    m.update({"repeat": rep, "mode": mode, "workers": n, "died": died, "worker_argv": argvs[0] if n == 1 else argvs,
              "omp_bind": binds, "disk_dir_bytes_at_end": disk_bytes, "shared_dir_bytes_at_end": shared_bytes,
              "counters": summed, "per_worker_counters": per_worker if n > 1 else None,
              "logs": [str(p.log_path) for p in st.procs]})
    c = m["counters"]
    log(f"{tag}: {m['ok']}/{m['requests']} ok, returning TTFT p50 {fmt(m['returning_ttft_p50_ms'])} "
        f"p99 {fmt(m['returning_ttft_p99_ms'])} ms, first-turn p50 {fmt(m['first_ttft_p50_ms'])} ms, "
        f"returning hit {fmt((m['returning_hit_rate'] or 0) * 100)} %, {m['request_per_s']:.3f} req/s, "
        f"disk written {c.get('turbine_kvbm_bytes_written_total{disk}', 0) / 2**20:.0f} MiB, "
        f"hits host/disk/shared {c.get('turbine_kvbm_hits_total{host}', 0):.0f}/"
        f"{c.get('turbine_kvbm_hits_total{disk}', 0):.0f}/{c.get('turbine_kvbm_hits_total{shared}', 0):.0f}, "
        f"{wall:.0f}s")
    if "returning_phases_ms" in m:
        log(f"{tag}: returning turns' means, ms: " + ", ".join(f"{k} {fmt(v)}" for k, v in
                                                               m["returning_phases_ms"].items()))
    if died or m["errors"]:
        log(f"{tag}: errors {m['error_samples']} died {died}")
    return m


# --------------------------------------------------------------------------- summary
KEYS = ("returning_ttft_p50_ms", "returning_ttft_p99_ms", "first_ttft_p50_ms", "first_ttft_p99_ms",
        "returning_hit_rate", "request_per_s", "prompt_tok_s", "wall_s")
COUNTERS = ("turbine_kvbm_bytes_written_total{disk}", "turbine_kvbm_bytes_written_total{host}",
            "turbine_kvbm_bytes_written_total{shared}", "turbine_kvbm_hits_total{shared}",
            "turbine_kvbm_read_seconds_total{shared}", "turbine_kvbm_write_seconds_total{shared}",
            "turbine_kvbm_hits_total{host}", "turbine_kvbm_hits_total{disk}", "turbine_kvbm_misses_total",
            "turbine_kvbm_read_seconds_total{disk}", "turbine_kvbm_read_seconds_total{host}",
            "turbine_kvbm_write_seconds_total{disk}", "turbine_kvbm_write_seconds_total{host}")


def summarize(runs: list[dict], modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        s = {k: median([r[k] for r in rs if r.get(k) is not None]) for k in KEYS}
        s.update({k: median([r["counters"].get(k, 0.0) for r in rs]) for k in COUNTERS})
        s["repeats"] = len(rs)
        for key in ("first_turn_phases_ms", "returning_phases_ms"):
            if rs and all(key in r for r in rs):
                s[key] = {ph: median([r[key].get(ph) for r in rs]) for ph in [*PHASES, *STEP_PHASES]}
        s["per_repeat_returning_ttft_p50_ms"] = [r["returning_ttft_p50_ms"] for r in rs]
        s["per_turn_ttft_p50_ms"] = {t: median([r["per_turn_ttft_p50_ms"][t] for r in rs])
                                     for t in rs[0]["per_turn_ttft_p50_ms"]} if rs else {}
        out[mode] = s
    # Ratios against the no-tier row with as many workers.
    for mode, s in out.items():
        base = out.get("none2" if mode_workers(mode) == 2 else "none")
        if base:
            s["returning_ttft_p50_speedup_vs_none"] = ratio(base["returning_ttft_p50_ms"], s["returning_ttft_p50_ms"])
            s["returning_ttft_p99_speedup_vs_none"] = ratio(base["returning_ttft_p99_ms"], s["returning_ttft_p99_ms"])
            s["request_per_s_vs_none"] = ratio(s["request_per_s"], base["request_per_s"])
    return out


def markdown(summary: dict) -> str:
    lines = ["| mode | returning TTFT p50 ms | p99 ms | p50 speedup vs none | first-turn TTFT p50 ms | returning hit rate "
             "| req/s (x none) | disk MiB written | host / disk / shared hits (blocks) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        lines.append(
            f"| {mode} | {fmt(s['returning_ttft_p50_ms'])} | {fmt(s['returning_ttft_p99_ms'])} | "
            f"{fmt(s.get('returning_ttft_p50_speedup_vs_none'))}x | {fmt(s['first_ttft_p50_ms'])} | "
            f"{fmt((s['returning_hit_rate'] or 0) * 100)} % | {fmt(s['request_per_s'])} "
            f"({fmt(s.get('request_per_s_vs_none'))}x) | {s['turbine_kvbm_bytes_written_total{disk}'] / 2**20:.0f} | "
            f"{s['turbine_kvbm_hits_total{host}']:.0f} / {s['turbine_kvbm_hits_total{disk}']:.0f} / "
            f"{s['turbine_kvbm_hits_total{shared}']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=str(REPO_ROOT / ".venv/bin/python"))
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`'s SmolLM2)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: no CPU core binding, --dtype auto unless given (benchmarks/gpu/gpu_tests.sh)")
    p.add_argument("--dtype", default=None, help="the worker's --dtype (default: float32 on cpu, auto on gpu)")
    p.add_argument("--served-model-name", default=SERVED)
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this (default: SmolLM2's)")
    p.add_argument("--block-size", type=int, default=None, help="the worker's --block-size (default: vLLM's)")
    p.add_argument("--worker-args", default="", help="more worker flags, e.g. '--load-format dummy "
                                                     "--gpu-memory-utilization 0.5'")
    p.add_argument("--modes", default="none,host,host+disk", help="comma-separated; see the module doc")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--engine-blocks", type=int, default=24,
                   help="--num-gpu-blocks-override (of vLLM's CPU default 128-token blocks, or --block-size)")
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--host-gb", type=float, default=1.0, help="host tier of the `host` mode")
    p.add_argument("--small-host-gb", type=float, default=0.125, help="host tier of host+disk and small-host")
    p.add_argument("--disk-gb", type=float, default=2.0)
    p.add_argument("--shared-gb", type=float, default=1.0, help="shared tier of the `shared2` mode (both workers)")
    p.add_argument("--omp-bind-2w", default="0|1", help="the two-worker modes: VLLM_CPU_OMP_THREADS_BIND of "
                   "worker 0 and worker 1, '|'-separated (default: a core each)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--omp-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND for the worker in every mode "
                   "('auto': vLLM's choice, which differs with and without a connector)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--run-dir", default=None, help="logs and disk tiers (default: a temp folder)")
    p.add_argument("--disk-root", default=None, help="where the disk tiers' folders go (default: --run-dir), e.g. "
                   "/dev/shm to tell the disk's own cost from the writes' cost in the worker")
    p.add_argument("--py-spy", default=None, help="a py-spy binary: record the worker of every tiered mode while "
                   "the workload runs (RUN/pyspy-TAG-{all,gil}.txt)")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--lock", default=os.environ.get("TURBINE_ENGINE_LOCK"),
                   help="flock this file around the engine runs (e.g. /tmp/turbine-engine.lock on a shared host)")
    p.add_argument("--lock-scope", choices=("repeat", "all"), default="repeat",
                   help="hold --lock for each repeat or for the whole benchmark")
    a = p.parse_args(argv)
    exit_on_sigterm()
    a.model = a.model or default_model(a.python)
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "auto")
    modes = [m for m in a.modes.split(",") if m]
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="kv_tiers_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for m in modes:
        mode_flags(a, m, run_dir)  # refuse an unknown mode before starting anything
    if any(mode_workers(m) == 2 for m in modes):
        if len(a.omp_bind_2w.split("|")) != 2:
            raise SystemExit(f"--omp-bind-2w {a.omp_bind_2w!r}: give two bindings, '|'-separated")
        if a.conversations % 2 == 0:
            # Round-robin over 2 workers, turn-major: an even count sends every turn of a conversation to one worker.
            raise SystemExit(f"--conversations {a.conversations}: the two-worker modes need an odd count, so that "
                             f"round-robin sends a returning turn to the other worker")
    lens = [len(i["prompt_ids"]) for t in conversations(a) for i in t]
    block = a.block_size or 128  # the CPU build's default
    block_bytes = block * kv_bytes_per_token(a.model, a.dtype)
    working_blocks = sum((len(t[-1]["prompt_ids"]) + a.output_tokens) // block for t in zip(*conversations(a)))
    describe = {"omp_bind": a.omp_bind, "conversations": a.conversations, "turns": a.turns, "context_tokens": a.context_tokens,
                "user_tokens": a.user_tokens, "answer_tokens": a.answer_tokens, "output_tokens": a.output_tokens,
                "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens), "engine_blocks": a.engine_blocks,
                "block_size": block, "engine_usable_tokens": (a.engine_blocks - 1) * block,
                "working_set_blocks": working_blocks,
                "working_set_over_engine": working_blocks / (a.engine_blocks - 1),
                "block_bytes": block_bytes, "host_gb": a.host_gb, "small_host_gb": a.small_host_gb,
                "small_host_blocks": int(a.small_host_gb * 2**30 // block_bytes), "disk_gb": a.disk_gb,
                "shared_gb": a.shared_gb, "omp_bind_2w": a.omp_bind_2w}
    log(f"workload: {json.dumps(describe)}")
    runs = []
    with engine_lock(a.lock) if a.lock and a.lock_scope == "all" else contextlib.nullcontext():
        for rep in range(a.repeats):
            runs += run_repeat(a, modes, rep, run_dir)
    summary = summarize(runs, modes)
    table = markdown(summary)
    print(table)
    result = {"benchmark": "kv_tiers", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "host": f"{platform.node()} {os.cpu_count()} cores (this 2-core AVX2 CPU host, shared with other helpers)",
              "argv": sys.argv, "workload": describe, "modes": modes, "summary": summary, "table": table, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

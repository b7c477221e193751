#!/usr/bin/env python3
r"""Chaos benchmark (issue #15): open-loop traffic at a fraction of capacity while one random worker is
SIGKILLed and restarted every --kill-interval-s seconds; with request migration on, no request may fail.

A fleet of worker processes (each its own process group, so one can be SIGKILLed) behind one frontend,
on a private file-discovery folder:

  mocker  --workers 8 x  python -m turbine.mocker --startup-time S --max-num-seqs M [--profile P] ...
  vllm    --workers 2 x  python -m turbine.vllm --model MODEL --enforce-eager --max-model-len 2048
                         --max-num-seqs M   (VLLM_CPU_KVCACHE_SPACE=1; its start-up is real)
  python -m turbine.frontend --http-port P [--migration-limit N]

Load: streaming /v1/completions with random token-id prompts of --isl tokens (no prefix reuse),
--osl output tokens (ignore_eos), Poisson arrivals at --load-fraction x capacity from this process
(asyncio + httpx).  Capacity (requests/s) is measured first on the same fleet (--capacity measure):
a closed loop of workers x max-num-seqs concurrent streams (every batch full, nothing queued) for
--capacity-s seconds; requests/s = output tokens streamed in the window after a warm-up / --osl.
For the mocker the timing model's figure is printed beside it (`model_capacity_rps`); --capacity-rps
skips the measurement.

Phases, all with the same load and seed, in the order given by --phases:
  nokill  no faults: the reference for the p99 impact
  off     kills, frontend --migration-limit 0 (or no flag at all with --off-flag none: main before
          migration)
  on      kills, frontend --migration-limit --migration-limit-on (default 3)
Kills: at every multiple of --kill-interval-s a random worker (all of them are candidates) gets
SIGKILL on its process group and is started again at once; the restarted one registers after its
start-up.  After the load, in-flight requests finish and the surviving mockers' KV blocks in use are
read from /metrics (they must be 0).

Reported per phase: requests sent, failed (count, %, and why), TTFT p50/p99 (first text chunk), ITL
p50/p99 (per request: (last token - first token) / (tokens - 1), percentiles over completed
requests), the p99 of each request's longest gap between tokens (a migration's stall shows here),
and the ratios of the p99s to the nokill phase's.

  .venv/bin/python -m benchmarks.lifecycle.chaos --engine mocker --duration-s 600 --phases nokill,off,on \
      --out benchmarks/results/lifecycle/chaos-mocker-$(date +%F).json
  flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.lifecycle.chaos --engine vllm --workers 2 \
      --duration-s 150 --kill-interval-s 30 --phases nokill,off,on --out benchmarks/results/lifecycle/chaos-vllm-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.load import sse_chunks
from benchmarks.lib.paths import default_model
from benchmarks.lib.proc import exit_on_sigterm, http_get_json, log, Proc, tail
from benchmarks.lib.stack import turbine_origin
from turbine.runtime.ports import free_port


MODEL_NAME = "chaos"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# --------------------------------------------------------------------------- the fleet
class Fleet:
    """N worker processes (slots) and a frontend on one file-discovery folder."""

    def __init__(self, a: argparse.Namespace, model: str, run_dir: Path, frontend_args: list[str]):
        self.a, self.model, self.run_dir = a, model, run_dir
        self.env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", PYTHONUNBUFFERED="1",
                        TURBINE_DISCOVERY_DIR=str(run_dir / "discovery"), VLLM_CPU_KVCACHE_SPACE="1",
                        VLLM_NO_USAGE_STATS="1")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers: list[Proc | None] = [None] * a.workers
        self.system_ports = [0] * a.workers
        self.starts = [0] * a.workers
        self.frontend = Proc("frontend", [a.python, "-m", "turbine.frontend", "--http-port", str(self.port),
                                          *frontend_args], self.env, run_dir / "frontend.log")
        for slot in range(a.workers):
            self.start_worker(slot)

    def worker_argv(self, port: int) -> list[str]:
        a = self.a
        if a.engine == "mocker":
            argv = [a.python, "-m", "turbine.mocker", "--model", self.model, "--served-model-name", MODEL_NAME,
                    "--system-port", str(port), "--startup-time", str(a.startup_time),
                    "--max-num-seqs", str(a.max_num_seqs), "--speedup-ratio", str(a.speedup_ratio)]
            return argv + (["--profile", a.profile] if a.profile else [])
        return [a.python, "-m", "turbine.vllm", "--model", self.model, "--served-model-name", MODEL_NAME,
                "--system-port", str(port), "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", str(a.max_num_seqs)]

    def start_worker(self, slot: int) -> None:
        self.starts[slot] += 1
        self.system_ports[slot] = free_port()
        name = f"worker{slot}-{self.starts[slot]}"
        self.workers[slot] = Proc(name, self.worker_argv(self.system_ports[slot]), self.env,
                                  self.run_dir / f"{name}.log")

    def kill_and_restart(self, slot: int) -> None:
        proc = self.workers[slot]
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)  # the worker and its engine process (vLLM)
        except ProcessLookupError:
            pass
        proc.popen.wait()
        proc.stop(1)  # closes its log
        self.start_worker(slot)

    def ready_slots(self) -> list[int]:
        """Slots whose worker says healthy on its status server (started up and registered)."""
        ready = []
        for slot, port in enumerate(self.system_ports):
            try:
                if http_get_json(f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200:
                    ready.append(slot)
            except OSError:
                pass
        return ready

    def instances(self) -> int:
        status, body = http_get_json(f"{self.url}/health")
        return int((body.get("models") or {}).get(MODEL_NAME, 0)) if isinstance(body, dict) else 0

    def wait_all_visible(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for p in [self.frontend, *self.workers]:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{tail(p.log_path)}")
            try:
                if self.instances() == self.a.workers:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not all {self.a.workers} workers visible after {timeout:.0f}s; logs in {self.run_dir}")

    def kv_blocks_in_use(self) -> list[float | None]:
        """Per slot: the mocker's turbine_mocker_kv_blocks_in_use (vLLM: None)."""
        import urllib.request

        out = []
        for slot, port in enumerate(self.system_ports):
            if self.a.engine != "mocker":
                out.append(None)
                continue
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("turbine_mocker_kv_blocks_in_use{")))
            except OSError:
                out.append(None)
        return out

    def stop(self) -> None:
        for p in [*self.workers, self.frontend]:
            if p is not None:
                p.stop(10)


# --------------------------------------------------------------------------- load
async def one_request(client, url: str, a: argparse.Namespace, rng: random.Random, t0: float) -> dict:
    prompt = [rng.randrange(1000, 40000) for _ in range(a.isl)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": a.osl, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    rec = {"t": time.monotonic() - t0, "ttft": None, "itl": None, "max_gap": None, "tokens": 0, "error": None}
    times = []
    sent = time.monotonic()
    try:
        async for chunk in sse_chunks(client, f"{url}/v1/completions", body):
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(time.monotonic())
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # a broken stream is what this benchmark counts; record how it broke
        rec["error"] = f"{type(exc).__name__}: {exc}"[:160]
    if rec["error"] is None and rec["tokens"] != a.osl:
        rec["error"] = f"{rec['tokens']} of {a.osl} tokens"
    if times:
        rec["ttft"] = times[0] - sent
        if len(times) > 1:
            gaps = [b - a_ for a_, b in zip(times, times[1:])]
            rec["max_gap"] = max(gaps)
            rec["itl"] = (times[-1] - times[0]) / (len(times) - 1)
    rec["token_times"] = [t - t0 for t in times] if a.keep_token_times else None
    return rec


async def closed_loop(url: str, a: argparse.Namespace, concurrency: int, seconds: float) -> list[dict]:
    import httpx

    rng = random.Random(a.seed + 1)
    a2 = argparse.Namespace(**{**vars(a), "keep_token_times": True})
    records: list[dict] = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def loop():
            while time.monotonic() - t0 < seconds:
                records.append(await one_request(client, url, a2, rng, t0))
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return records


async def open_loop(fleet: Fleet, a: argparse.Namespace, rate: float, kills: bool) -> tuple[list[dict], list[dict]]:
    import httpx

    rng = random.Random(a.seed)  # the same arrivals and prompts in every phase
    kill_rng = random.Random(a.seed + 2)
    records: list[dict] = []
    events: list[dict] = []
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)

    async def killer():
        n = 1
        while True:
            at = n * a.kill_interval_s
            if at >= a.duration_s:
                return
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            n += 1
            # A random worker among the ready ones, while another one is ready to take over (a worker
            # still starting up after the previous kill is not a candidate).
            ready = await asyncio.to_thread(fleet.ready_slots)
            if len(ready) < 2:
                events.append({"t": round(time.monotonic() - t0, 2), "skipped": f"only {len(ready)} ready"})
                log(f"  t={time.monotonic() - t0:5.0f}s no kill: only {len(ready)} worker(s) ready")
                continue
            slot = kill_rng.choice(ready)
            visible = await asyncio.to_thread(fleet.instances)
            inflight = sum(1 for t in tasks if not t.done())
            killed_at = time.monotonic() - t0
            await asyncio.to_thread(fleet.kill_and_restart, slot)
            events.append({"t": round(killed_at, 2), "slot": slot, "ready_before": len(ready),
                           "visible_before": visible, "in_flight": inflight})
            log(f"  t={killed_at:5.0f}s SIGKILL worker slot {slot} (restarted); {inflight} requests "
                f"in flight, {len(ready)} workers ready, {visible} visible to the frontend")

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        kill_task = asyncio.create_task(killer()) if kills else None
        next_at = 0.0
        while True:
            next_at += rng.expovariate(rate)
            if next_at >= a.duration_s:
                break
            await asyncio.sleep(max(0.0, t0 + next_at - time.monotonic()))
            req_rng = random.Random(rng.random())
            task = asyncio.create_task(one_request(client, fleet.url, a, req_rng, t0))
            task.add_done_callback(lambda t: records.append(t.result()))
            tasks.append(task)
        if kill_task:
            await kill_task
        await asyncio.gather(*tasks)
    return records, events


def model_capacity_rps(a: argparse.Namespace) -> float | None:
    """Requests/s of the fleet by the mocker's timing model, every batch full (max-num-seqs decoding,
    each request's prefill spread over the steps): a cross-check of the measured figure."""
    if a.engine != "mocker":
        return None
    from turbine.mocker.timing import TimingProfile, attention_pairs, load_profile

    prof = load_profile(a.profile) if a.profile else TimingProfile()
    s = a.max_num_seqs
    per_step_prefill = (s / a.osl) * (prof.prefill_ms_per_token * a.isl
                                      + prof.prefill_ms_per_token_pair * attention_pairs(a.isl, 0))
    step_ms = (prof.step_base_ms + prof.decode_ms_per_seq * s + prof.decode_ms_per_kv_token * s * (a.isl + a.osl / 2)
               + per_step_prefill) / (a.speedup_ratio or 1)
    return a.workers * (s / a.osl) / (step_ms / 1000)


def summarize(records: list[dict], duration: float) -> dict:
    done = [r for r in records if r["error"] is None]
    failed = [r for r in records if r["error"] is not None]
    reasons: dict[str, int] = {}
    for r in failed:
        key = re.sub(r"\b[0-9a-f]{16}\b", "W", re.sub(r"127\.0\.0\.1:\d+", "ADDR", r["error"]))[:110]
        reasons[key] = reasons.get(key, 0) + 1
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    itl = [r["itl"] for r in done if r["itl"] is not None]
    gaps = [r["max_gap"] for r in done if r["max_gap"] is not None]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {"sent": len(records), "failed": len(failed),
            "failed_pct": round(100 * len(failed) / len(records), 3) if records else None,
            "failure_reasons": reasons, "achieved_rps": round(len(records) / duration, 3),
            "ttft_p50_ms": ms(pct(ttft, .5)), "ttft_p99_ms": ms(pct(ttft, .99)),
            "itl_p50_ms": ms(pct(itl, .5)), "itl_p99_ms": ms(pct(itl, .99)),
            "max_gap_p50_ms": ms(pct(gaps, .5)), "max_gap_p99_ms": ms(pct(gaps, .99)),
            "max_gap_max_ms": ms(max(gaps) if gaps else None)}


def frontend_args_for(a: argparse.Namespace, phase: str) -> list[str]:
    if phase == "on":
        return ["--migration-limit", str(a.migration_limit_on)]
    if phase == "off":
        return [] if a.off_flag == "none" else ["--migration-limit", "0"]
    return [] if a.off_flag == "none" else ["--migration-limit", str(a.migration_limit_on)]


def run_phase(a: argparse.Namespace, model: str, phase: str, rate: float | None, work: Path) -> dict:
    run_dir = work / phase
    run_dir.mkdir(parents=True)
    fleet = Fleet(a, model, run_dir, frontend_args_for(a, phase))
    try:
        ready_s = fleet.wait_all_visible(a.startup_timeout)
        log(f"{phase}: {a.workers} {a.engine} workers visible after {ready_s:.0f}s; frontend {fleet.url}")
        result: dict = {"phase": phase, "frontend_args": frontend_args_for(a, phase), "fleet_ready_s": round(ready_s, 1),
                        "logs": str(run_dir)}
        if rate is None:  # the capacity measurement
            conc = a.workers * a.max_num_seqs
            recs = asyncio.run(closed_loop(fleet.url, a, conc, a.capacity_s))
            warm = a.capacity_s * 0.25
            tokens = sum(1 for r in recs for t in r["token_times"] or [] if warm <= t <= a.capacity_s)
            window = a.capacity_s - warm
            result.update(concurrency=conc, seconds=a.capacity_s, warmup_s=warm,
                          tokens_in_window=tokens, capacity_rps=round(tokens / window / a.osl, 3),
                          failed=sum(1 for r in recs if r["error"]))
            log(f"capacity: {result['capacity_rps']} requests/s ({tokens / window:.0f} tokens/s at concurrency {conc})")
            return result
        log(f"{phase}: {a.duration_s:.0f}s at {rate:.2f} requests/s" + (
            f", a worker SIGKILLed every {a.kill_interval_s:.0f}s" if phase != "nokill" else ""))
        recs, events = asyncio.run(open_loop(fleet, a, rate, kills=phase != "nokill"))
        # Each restarted worker is back before the phase ends only if its start-up allows; wait for it.
        try:
            fleet.wait_all_visible(a.startup_timeout)
        except RuntimeError as exc:
            result["not_back"] = str(exc)[:300]
        time.sleep(2)
        result.update(summarize(recs, a.duration_s), kills=events, kv_blocks_in_use_after=fleet.kv_blocks_in_use(),
                      rate_rps=round(rate, 3))
        if a.keep_records:
            result["records"] = recs
        log(f"{phase}: {result['failed']} of {result['sent']} failed {result['failure_reasons']}; TTFT p50/p99 "
            f"{result['ttft_p50_ms']}/{result['ttft_p99_ms']} ms, ITL p50/p99 {result['itl_p50_ms']}/"
            f"{result['itl_p99_ms']} ms, max gap p99 {result['max_gap_p99_ms']} ms; KV blocks in use after: "
            f"{result['kv_blocks_in_use_after']}")
        return result
    finally:
        fleet.stop()


def markdown(phases: dict) -> str:
    ref = phases.get("nokill")
    lines = ["| phase | sent | failed | failed % | TTFT p50 / p99 ms | ITL p50 / p99 ms | longest gap p99 ms "
             "| TTFT p99 / nokill | ITL p99 / nokill | gap p99 / nokill |", "|---|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for name, r in phases.items():
        if "sent" not in r:
            continue

        def rat(key):
            return f"{r[key] / ref[key]:.2f}" if ref and r.get(key) and ref.get(key) else "–"
        lines.append(f"| {name} | {r['sent']} | {r['failed']} | {r['failed_pct']} | {r['ttft_p50_ms']} / "
                     f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['max_gap_p99_ms']} | "
                     f"{rat('ttft_p99_ms')} | {rat('itl_p99_ms')} | {rat('max_gap_p99_ms')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("mocker", "vllm"), default="mocker")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: mocker 8, vllm 2)")
    p.add_argument("--phases", default="nokill,off,on", help="comma list of nokill, off, on (in this order)")
    p.add_argument("--duration-s", type=float, default=600, help="load time per phase")
    p.add_argument("--kill-interval-s", type=float, default=30)
    p.add_argument("--migration-limit-on", type=int, default=3, help="the frontend's --migration-limit when on")
    p.add_argument("--off-flag", choices=("zero", "none"), default="zero",
                   help="off: --migration-limit 0 (zero) or no flag at all (none: a frontend before migration)")
    p.add_argument("--load-fraction", type=float, default=0.7, help="offered load / capacity")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip the measurement: this many requests/s")
    p.add_argument("--capacity-s", type=float, default=60, help="closed-loop capacity measurement time")
    p.add_argument("--isl", type=int, default=200, help="prompt tokens")
    p.add_argument("--osl", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="per worker (default: mocker 16, vllm 8)")
    p.add_argument("--startup-time", type=float, default=20.0, help="mocker: simulated engine start-up (s)")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker")
    p.add_argument("--profile", default=None, help="mocker timing profile JSON (default: built-in)")
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`'s)")
    p.add_argument("--python", default=sys.executable, help="Turbine's python (its venv)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--keep-records", action="store_true", help="every request's record in the JSON")
    p.add_argument("--work-dir", default=None, help="logs (default: a temp folder)")
    p.add_argument("--out", default=None, help="JSON results file")
    a = p.parse_args(argv)
    exit_on_sigterm()
    a.keep_token_times = False
    a.workers = a.workers or (8 if a.engine == "mocker" else 2)
    a.max_num_seqs = a.max_num_seqs or (16 if a.engine == "mocker" else 8)
    phases = [x for x in a.phases.split(",") if x]
    for x in phases:
        if x not in ("nokill", "off", "on"):
            p.error(f"--phases: unknown phase {x!r}")
    if not 0 < a.load_fraction:
        p.error("--load-fraction must be > 0")
    if a.kill_interval_s <= 0 or a.duration_s <= 0:
        p.error("--kill-interval-s and --duration-s must be > 0")
    model = a.model or default_model(a.python)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    doc: dict = {"benchmark": "chaos", "started_utc": started, "argv": sys.argv, "args": vars(a), "model": model,
                 "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
                 "turbine": turbine_origin(a.python), "model_capacity_rps": model_capacity_rps(a), "phases": {}}
    log(f"timing-model capacity: {doc['model_capacity_rps']} requests/s")
    capacity = a.capacity_rps
    if capacity is None:
        doc["capacity"] = run_phase(a, model, "capacity", None, work)
        capacity = doc["capacity"]["capacity_rps"]
    rate = a.load_fraction * capacity
    doc["capacity_rps"], doc["rate_rps"] = capacity, rate

    def write():
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")

    for phase in phases:
        doc["phases"][phase] = run_phase(a, model, phase, rate, work)
        write()
    doc["host"]["load_avg_end"] = os.getloadavg()
    doc["table"] = markdown(doc["phases"])
    write()
    print(doc["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

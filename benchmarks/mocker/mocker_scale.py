#!/usr/bin/env python3
r"""Mocker scale: how many simulated workers one `turbine mocker` process sustains in real time.

For each (workers N, request rate R) point: start one mocker process with N workers at
--speedup-ratio 1 (through benchmarks/mocker/_mocker_lag.py, which records how late every simulated
step ends), then send an open-loop Poisson stream of R requests/s for --duration seconds,
round-robin over the N instances, straight over Turbine's request plane (the `generate`
endpoint, as `turbine mocker calibrate` does; no frontend in the path; its ceiling is measured
by frontend_ceiling.py).  Each request has a fresh random prompt of --isl tokens and asks
for --osl tokens with ignore_eos.

"Falling behind real time" is measured two ways:
- step lag (inside the mocker): how late each simulated step ends past its deadline.  The
  process keeps up when the p99 lag is at most --max-lag-frac (default 10 %) of the median
  simulated step time, and no step is a second or more late (the engine's catch-up reset);
- client side: ITL p50 observed by the load generator / median simulated step time (1.0 =
  tokens arrive exactly at the profile's pace), and completed / offered requests.
A point passes when the step-lag criterion holds and >= 99 % of the requests sent during the
window finish with no error.  The mocker's garbage-collector passes in the window are counted
too: each one stalls every worker of the process.  The mocker runs a full pass every
--gc-interval (60) seconds after start-up, so a --duration of 75 s puts one in every window.

--variants runs each point with several mocker flag sets in turn (the same load, one process
at a time), e.g. the paced collector against Python's automatic one:

  .venv/bin/python -m benchmarks.mocker.mocker_scale --workers 128,256 --rate 200 --duration 75 --repeats 2 \
      --variants 'paced=;automatic=--gc-interval 0'
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.lib.args import parse_int_list
from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import log, proc_cpu_s
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.stack import Stack, read_cards, turbine_env
from benchmarks.lib.stats import fmt, pct
from turbine.runtime.ports import free_port


SERVED = "smollm2-135m-instruct"


async def drive(records, rate: float, duration: float, isl: int, osl: int, vocab: int, seed: int) -> dict:
    from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
    from turbine.runtime.request_plane import RequestPlaneClient

    rng = random.Random(seed)
    client = RequestPlaneClient()
    results: list[dict] = []
    n_total = int(rate * duration)
    # Prompts made up front, so the load generator spends its time on the streams.
    prompts = [[rng.randrange(1000, vocab) for _ in range(isl)] for _ in range(n_total)]
    arrivals, t = [], 0.0
    for _ in range(n_total):
        t += rng.expovariate(rate)
        arrivals.append(t)

    async def one(i: int, rec) -> None:
        req = GenerateRequest(request_id=f"scale-{uuid.uuid4().hex[:8]}", model=SERVED, token_ids=prompts[i],
                              stop=StopConditions(max_tokens=osl, ignore_eos=True))
        t0 = time.monotonic()
        times, tokens, err = [], 0, None
        try:
            async for chunk in client.stream(rec.address, rec.endpoint, req, GenerateOutput):
                if chunk.finish_reason and chunk.finish_reason.startswith("error"):
                    err = chunk.finish_reason
                if chunk.token_ids:
                    times.append((time.monotonic(), len(chunk.token_ids)))
                    tokens += len(chunk.token_ids)
        except Exception as e:  # noqa: BLE001
            err = repr(e)
        end = time.monotonic()
        gaps = [(b[0] - a[0]) / b[1] for a, b in zip(times, times[1:])]
        results.append({"start": t0, "end": end, "ttft_ms": (times[0][0] - t0) * 1000 if times else None,
                        "itl_ms": statistics.median(gaps) * 1000 if gaps else None, "tokens": tokens, "error": err})

    start = time.monotonic()
    wall_start = time.time()
    tasks = []
    send_lag = []
    for i, at in enumerate(arrivals):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            send_lag.append(-delay)
        tasks.append(asyncio.create_task(one(i, records[i % len(records)])))
    sent_s = time.monotonic() - start
    await asyncio.wait(tasks, timeout=duration + 120)
    for task in tasks:
        task.cancel()
    await client.close()
    return {"results": results, "sent": len(tasks), "send_window_s": sent_s, "wall_start": wall_start,
            "wall_send_end": wall_start + sent_s, "loadgen_send_late_ms_p99": (pct(send_lag, 99) or 0) * 1000,
            "loadgen_sends_late": len(send_lag)}


def run_point(a, n_workers: int, rate: float, run_dir: Path, variant: str = "", variant_args: str = "",
              repeat: int = 1) -> dict:
    tag = f"w{n_workers}_r{int(rate)}" + (f"_{variant}" if variant else "") + f"_{repeat}"
    st = Stack("mocker", run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    lag_file = run_dir / f"{tag}_lag.json"
    argv = [a.python, str(Path(__file__).resolve().parent / "_mocker_lag.py"), "--served-model-name", SERVED,
            "--num-workers", str(n_workers), "--speedup-ratio", "1", "--system-port", str(free_port()),
            *(["--profile", a.profile] if a.profile else []), *a.mocker_args.split(), *variant_args.split()]
    proc = st.spawn("mocker", argv, turbine_env(disc, MOCKER_LAG_FILE=str(lag_file)))
    if a.pin:  # before the mocker starts its threads, which inherit the main thread's CPU set
        os.sched_setaffinity(proc.popen.pid, {0})
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))

    def ready():
        cards, recs = read_cards(disc)
        st.records = [r for r in recs if r.endpoint == "generate"]
        return len(cards) >= n_workers and len(st.records) >= n_workers
    try:
        st.wait_ready(ready, a.startup_timeout)
        from turbine.mocker.model_info import read_model_info
        cards, _ = read_cards(disc)
        vocab = read_model_info(cards[0].tokenizer_path).vocab_size
        time.sleep(2)
        wait_quiet()
        cpu0, w0 = proc_cpu_s(proc.popen.pid), time.monotonic()
        cpu_self0 = time.process_time()
        load = asyncio.run(drive(st.records, rate, a.duration, a.isl, a.osl, vocab, a.seed))
        cpu1, w1 = proc_cpu_s(proc.popen.pid), time.monotonic()
        cpu_self = time.process_time() - cpu_self0
    finally:
        st.stop()
    lag = json.loads(lag_file.read_text()) if lag_file.exists() else {"wake": [], "lag_ms": [], "step_ms": []}
    lo, hi = load["wall_start"] + a.settle, load["wall_send_end"]
    idx = [i for i, w in enumerate(lag["wake"]) if lo <= w <= hi]
    lags = [lag["lag_ms"][i] for i in idx]
    gc_ms = [ms for at, ms, _gen in lag.get("gc", []) if lo <= at <= hi]
    steps = [lag["step_ms"][i] for i in idx if lag["step_ms"][i] > 0]
    res = load["results"]
    ok = [r for r in res if r["error"] is None and r["tokens"] == a.osl]
    # Requests started inside the steady window (after settling) for the client-side latencies.
    t_start = min((r["start"] for r in res), default=0)
    steady = [r for r in ok if r["start"] - t_start >= a.settle]
    itls = [r["itl_ms"] for r in steady if r["itl_ms"] is not None]
    ttfts = [r["ttft_ms"] for r in steady if r["ttft_ms"] is not None]
    step_p50 = statistics.median(steps) if steps else None
    lag_p99 = pct(lags, 99)
    out = {
        "variant": variant, "repeat": repeat, "workers": n_workers, "rate": rate, "duration_s": a.duration, "isl": a.isl, "osl": a.osl,
        "sent": load["sent"], "completed_ok": len(ok), "errors": sum(1 for r in res if r["error"]),
        "unfinished": load["sent"] - len(res), "send_window_s": load["send_window_s"],
        "achieved_rate": len(ok) / load["send_window_s"] if load["send_window_s"] else None,
        "loadgen_sends_late": load["loadgen_sends_late"], "loadgen_send_late_ms_p99": load["loadgen_send_late_ms_p99"],
        "steps_in_window": len(lags), "step_ms_p50": step_p50,
        "lag_ms_p50": pct(lags, 50), "lag_ms_p90": pct(lags, 90), "lag_ms_p99": lag_p99, "lag_ms_max": max(lags, default=None),
        "gc_passes": len(gc_ms), "gc_ms_total": sum(gc_ms), "gc_ms_max": max(gc_ms, default=None),
        "ttft_ms_p50": pct(ttfts, 50), "itl_ms_p50": pct(itls, 50), "itl_ms_p99": pct(itls, 99),
        "itl_over_step": (pct(itls, 50) / step_p50) if itls and step_p50 else None,
        "mocker_cpu_util": ((cpu1 - cpu0) / (w1 - w0)) if cpu0 is not None and cpu1 is not None else None,
        "loadgen_cpu_util": cpu_self / (w1 - w0),
        "mocker_argv": argv,
    }
    lag_ok = (lag_p99 is not None and step_p50 is not None and lag_p99 <= a.max_lag_frac * step_p50
              and (out["lag_ms_max"] or 0) < 1000)
    out["keeps_up"] = bool(lag_ok and load["sent"] and len(ok) >= 0.99 * load["sent"])
    log(f"{tag}: {variant_args or ''} keeps_up={out['keeps_up']} lag p50/p99/max {fmt(out['lag_ms_p50'], 2)}/{fmt(lag_p99, 2)}/"
        f"{fmt(out['lag_ms_max'], 1)} ms, gc passes {len(gc_ms)} (max {fmt(out['gc_ms_max'], 1)} ms), step p50 {fmt(step_p50, 1)} ms, ITL p50 {fmt(out['itl_ms_p50'], 1)} ms, "
        f"ok {len(ok)}/{load['sent']}, mocker cpu {fmt(out['mocker_cpu_util'], 2)}, loadgen cpu {fmt(out['loadgen_cpu_util'], 2)}")
    try:
        lag_file.unlink()  # large; the summary keeps what matters
    except OSError:
        pass
    return out


def markdown(points: list[dict], a) -> str:
    lines = [f"Load: Poisson arrivals, {a.isl} prompt tokens (random, unique) / {a.osl} output tokens (ignore_eos), "
             f"{a.duration:.0f} s per point, round-robin over the workers, request plane (no frontend).", "",
             "| variant | run | workers | offered req/s | ok / sent | step p50 (ms) | step lag p50 / p99 / max (ms) | p99 lag / step | "
             "GC passes (max ms) | ITL p50 (ms) | ITL p50 / step | TTFT p50 (ms) | mocker CPU | load-gen CPU | keeps up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in points:
        frac = p["lag_ms_p99"] / p["step_ms_p50"] if p.get("lag_ms_p99") is not None and p.get("step_ms_p50") else None
        lines.append(f"| {p.get('variant') or '-'} | {p.get('repeat', 1)} | {p['workers']} | {p['rate']:.0f} | {p['completed_ok']} / {p['sent']} | {fmt(p['step_ms_p50'], 1)} "
                     f"| {fmt(p['lag_ms_p50'], 2)} / {fmt(p['lag_ms_p99'], 2)} / {fmt(p['lag_ms_max'], 1)} | {fmt(frac, 3)} "
                     f"| {p.get('gc_passes', '-')} ({fmt(p.get('gc_ms_max'), 1)}) "
                     f"| {fmt(p['itl_ms_p50'], 1)} | {fmt(p['itl_over_step'], 2)} | {fmt(p['ttft_ms_p50'], 1)} "
                     f"| {fmt(p['mocker_cpu_util'], 2)} | {fmt(p['loadgen_cpu_util'], 2)} | {'yes' if p['keeps_up'] else '**no**'} |")
    return "\n".join(lines)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--workers", type=parse_int_list, default=[64, 128, 256])
    p.add_argument("--rate", type=lambda s: [float(x) for x in s.split(",")], default=[200.0],
                   help="aggregate requests/s, comma-separated (every worker count runs every rate)")
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--settle", type=float, default=5, help="seconds at the start of the window not counted")
    p.add_argument("--isl", type=int, default=200)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--profile", default=None, help="mocker timing profile (default: built-in)")
    p.add_argument("--mocker-args", default="", help="extra turbine mocker flags")
    p.add_argument("--variants", default="",
                   help="mocker versions to compare in this run, NAME=FLAGS;NAME=FLAGS, each point runs each in "
                        "turn, e.g. 'paced=;automatic=--gc-interval 0'")
    p.add_argument("--repeats", type=int, default=1, help="runs of every point (and variant), interleaved")
    p.add_argument("--pin", action="store_true",
                   help="run the mocker on CPU 0 and this load generator on the other CPUs, so that on a "
                        "small machine they do not preempt each other")
    p.add_argument("--max-lag-frac", type=float, default=0.10)
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "mocker" / f"mocker_scale-{today}.json"))
    a = p.parse_args(argv)
    if a.pin and (os.cpu_count() or 1) < 2:
        p.error("--pin needs at least 2 CPUs")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-mocker-scale-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    points, failures = [], 0
    started = time.time()
    variants = [tuple(v.split("=", 1)) if "=" in v else (v, "") for v in a.variants.split(";") if v] or [("", "")]
    for n in a.workers:
        for rate in a.rate:
            for repeat in range(1, a.repeats + 1):
                for name, flags in variants:
                    wait_quiet()
                    try:
                        points.append(run_point(a, n, rate, run_dir, name, flags, repeat))
                    except (RuntimeError, OSError) as e:
                        failures += 1
                        log(f"w{n} r{rate} {name} {repeat}: {e}")
    table = markdown(points, a)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "turbine_mocker_scale", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                               "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
                               "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": _cpu_model()},
                               "config": vars(a), "work_dir": str(run_dir), "points": points, "markdown": table},
                              indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

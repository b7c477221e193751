#!/usr/bin/env python3
r"""Turbine frontend-overhead benchmark.

Serves the same model with the same vLLM engine flags two ways and drives both with the
same aiperf load (streaming chat, fixed input/output lengths, ignore_eos):

  turbine   python -m turbine.frontend  +  one  python -m turbine.vllm  worker
  vllm      python -m vllm.entrypoints.openai.api_server   (vLLM's own OpenAI server)

Only one system runs at a time: start A, run every concurrency point, stop A, start B,
run every point, stop B, and repeat (A, B, A, B, ...).  The medians over the repeats are
printed as a Markdown table (plus every single run) and everything is written as JSON.

Run it with Turbine's venv python; aiperf lives in its own venv (see benchmarks/README.md):

  make bench-tools      # aiperf into .bench-venv, where this script finds it (or --aiperf / env AIPERF)
  .venv/bin/python -m benchmarks.frontend.frontend_overhead --concurrency 1,8,32 --repeats 5

The script is self-contained (standard library only).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from turbine.runtime.ports import free_port  # below the ephemeral range: no bind race

from benchmarks.lib.aiperf import point_record, requests_for, run_aiperf, warmup_for
from benchmarks.lib.args import parse_int_list
from benchmarks.lib.paths import REPO_ROOT, default_aiperf, default_model, versions
from benchmarks.lib.proc import log, tail
from benchmarks.lib.stack import Stack
from benchmarks.lib.stats import fmt, median

SYSTEMS = ("turbine", "vllm")
# --------------------------------------------------------------------------- helpers
class FailFast(Exception):
    """--fail-fast: stop measuring, but still write what was measured."""


# --------------------------------------------------------------------------- processes
def engine_flags(a: argparse.Namespace) -> list[str]:
    """vLLM engine flags, identical for both systems."""
    flags = ["--model", a.model, "--served-model-name", a.served_model_name,
             "--max-model-len", str(a.max_model_len)]
    if a.enforce_eager:
        flags.append("--enforce-eager")
    if not a.prefix_caching:
        # aiperf's warmup reuses prompts of the measured phase; with prefix caching on those
        # requests skip prefill and skew TTFT.  Off by default, for both systems alike.
        flags.append("--no-enable-prefix-caching")
    return flags + shlex.split(a.engine_args)


class System(Stack):
    """One serving stack, Turbine (frontend + one vLLM worker) or `vllm serve`: start(), base_url, stop()."""

    def __init__(self, name: str, args: argparse.Namespace, run_dir: Path, tag: str):
        super().__init__(name, run_dir, tag)
        self.args = args

    def engine_flags(self) -> list[str]:
        return engine_flags(self.args)

    def engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.args.kvcache_space)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self) -> None:
        py = self.args.python
        if self.name == "turbine":
            disc = tempfile.mkdtemp(prefix="discovery_", dir=self.run_dir)
            env = self.engine_env()
            env["TURBINE_DISCOVERY_DIR"] = disc
            env["TURBINE_DISCOVERY_BACKEND"] = "file"
            self.spawn("worker", [py, "-m", "turbine.vllm", *self.engine_flags(), "--system-port", str(free_port())],
                       env)
            fe_env = dict(os.environ, TURBINE_DISCOVERY_DIR=disc, TURBINE_DISCOVERY_BACKEND="file",
                          PYTHONUNBUFFERED="1")
            self.spawn("frontend", [py, "-m", "turbine.frontend", "--http-port", str(self.port)], fe_env)
        else:
            self.spawn("server", [py, "-m", "vllm.entrypoints.openai.api_server", *self.engine_flags(),
                                  "--host", "127.0.0.1", "--port", str(self.port)], self.engine_env())
        self.wait_ready(lambda: self.models_ready(self.args.served_model_name, self.name == "turbine"),
                        self.args.startup_timeout)
        # One tiny non-streaming chat request, so a broken server fails loudly before aiperf.
        self.sanity_check(self.args.served_model_name)

    def stop(self) -> None:
        # Turbine: frontend first, then the worker (reverse start order).
        super().stop(self.args.stop_timeout)


# --------------------------------------------------------------------------- reporting
def summarize(runs: list[dict], concurrencies: list[int]) -> dict:
    summary = {}
    for c in concurrencies:
        point = {}
        for sysname in SYSTEMS:
            ok = [r for r in runs if r["system"] == sysname and r["concurrency"] == c and r["ok"]]
            point[sysname] = {k: median([r["metrics"][k] for r in ok])
                              for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                        "itl_p50_ms", "itl_p99_ms")}
            point[sysname]["n_ok_runs"] = len(ok)
        t, v = point["turbine"], point["vllm"]
        point["throughput_ratio"] = (t["output_tok_s"] / v["output_tok_s"]
                                     if t["output_tok_s"] and v["output_tok_s"] else None)
        point["added_ttft_p50_ms"] = (t["ttft_p50_ms"] - v["ttft_p50_ms"]
                                      if t["ttft_p50_ms"] is not None and v["ttft_p50_ms"] is not None
                                      else None)
        # Per-repeat pairs (turbine vs the vllm run of the same repeat) for a spread estimate.
        ratios = []
        for rep in sorted({r["repeat"] for r in runs}):
            pair = {r["system"]: r for r in runs
                    if r["repeat"] == rep and r["concurrency"] == c and r["ok"]}
            if len(pair) == 2 and pair["vllm"]["metrics"]["output_tok_s"]:
                ratios.append(pair["turbine"]["metrics"]["output_tok_s"]
                              / pair["vllm"]["metrics"]["output_tok_s"])
        point["per_repeat_throughput_ratio"] = ratios
        summary[str(c)] = point
    return summary


def markdown(summary: dict, runs: list[dict], args: argparse.Namespace) -> str:
    lines = [f"### Turbine frontend overhead — {args.isl} in / {args.osl} out tokens, streaming chat, "
             f"medians of {args.repeats} repeat(s)", "",
             "| conc | tok/s Turbine | tok/s vllm | ratio T/V | TTFT p50 T / V (ms) | added TTFT p50 (ms) "
             "| TTFT p99 T / V (ms) | ITL p50 T / V (ms) | ITL p99 T / V (ms) | ok runs T / V |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, p in summary.items():
        t, v = p["turbine"], p["vllm"]
        lines.append(
            f"| {c} | {fmt(t['output_tok_s'])} | {fmt(v['output_tok_s'])} | {fmt(p['throughput_ratio'], 3)} "
            f"| {fmt(t['ttft_p50_ms'])} / {fmt(v['ttft_p50_ms'])} | {fmt(p['added_ttft_p50_ms'])} "
            f"| {fmt(t['ttft_p99_ms'])} / {fmt(v['ttft_p99_ms'])} "
            f"| {fmt(t['itl_p50_ms'])} / {fmt(v['itl_p50_ms'])} "
            f"| {fmt(t['itl_p99_ms'])} / {fmt(v['itl_p99_ms'])} | {t['n_ok_runs']} / {v['n_ok_runs']} |")
    lines += ["", "#### Per run", "",
              "| repeat | system | conc | requests | ok | errors | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | wall s |",
              "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        m = r.get("metrics") or {}
        lines.append(
            f"| {r['repeat']} | {r['system']} | {r['concurrency']} | {r['requests']} | {'yes' if r['ok'] else 'NO'} "
            f"| {fmt(m.get('errors'), 0)} | {fmt(m.get('output_tok_s'))} | {fmt(m.get('ttft_p50_ms'))} "
            f"| {fmt(m.get('ttft_p99_ms'))} | {fmt(m.get('itl_p50_ms'))} | {fmt(m.get('itl_p99_ms'))} "
            f"| {fmt(r.get('wall_s'), 0)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=default_aiperf(),
                   help="aiperf executable (env AIPERF; default: make bench-tools' .bench-venv/bin/aiperf, else PATH)")
    p.add_argument("--python", default=sys.executable,
                   help="python of the venv with turbine + vllm (default: this one)")
    p.add_argument("--model", default=None,
                   help="model folder (default: the one `turbine model prepare` prints)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for aiperf (default: --model)")
    p.add_argument("--served-model-name", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32], help="e.g. 1,8,32")
    p.add_argument("--repeats", type=int, default=3, help="A/B alternations per system")
    p.add_argument("--systems", default="turbine,vllm",
                   help="order within a repeat, comma-separated subset of: turbine,vllm")
    p.add_argument("--order", choices=("abab", "abba"), default="abab",
                   help="abab: same order every repeat; abba: reverse the order on odd repeats")
    p.add_argument("--requests-per-point", type=int, default=0,
                   help="fixed request count per point (0 = max(--min-requests, --requests-multiplier × conc))")
    p.add_argument("--requests-multiplier", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=10)
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="aiperf warmup requests per point (default: max(2, concurrency))")
    p.add_argument("--isl", type=int, default=256, help="input tokens per request")
    p.add_argument("--osl", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--use-server-token-count", action=argparse.BooleanOptionalAction, default=True,
                   help="count output tokens from the server's usage (default on)")
    p.add_argument("--aiperf-workers", type=int, default=0, help="aiperf --workers-max (0 = aiperf's default)")
    p.add_argument("--aiperf-args", default="", help="extra aiperf arguments (one shell-quoted string)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kvcache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM prefix caching (default off: warmup prompts would be cache hits)")
    p.add_argument("--engine-args", default="",
                   help="extra vLLM engine flags given to BOTH systems (one shell-quoted string)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--stop-timeout", type=float, default=60)
    p.add_argument("--point-timeout", type=float, default=900, help="seconds one aiperf run may take")
    p.add_argument("--cooldown", type=float, default=5, help="seconds of idle after each stop")
    p.add_argument("--work-dir", default=None,
                   help="logs + aiperf artifacts (default: /tmp/turbine-frontend-overhead-<timestamp>)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "frontend" / f"frontend_overhead-{today}.json"),
                   help="raw JSON results (default: benchmarks/results/frontend/frontend_overhead-<date>.json)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed point")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.aiperf:
        parser.error("--aiperf: no aiperf found (env AIPERF, .bench-venv/bin/aiperf, PATH): run `make bench-tools`")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems) or len(set(systems)) != len(systems):
        print(f"--systems {args.systems!r}: use a subset of {','.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("--repeats must be at least 1", file=sys.stderr)
        return 2
    if not os.access(args.aiperf, os.X_OK):
        print(f"--aiperf {args.aiperf!r} is not an executable", file=sys.stderr)
        return 2
    args.model = args.model or default_model(args.python)
    if not Path(args.model).is_dir():
        print(f"--model {args.model!r}: no such folder", file=sys.stderr)
        return 2

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.work_dir or f"/tmp/turbine-frontend-overhead-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out)
    if not out_path.is_absolute():
        out_path = (Path.cwd() / out_path).resolve()
    log(f"model {args.model}; logs and aiperf artifacts under {run_dir}")
    for c in args.concurrency:
        log(f"  concurrency {c}: {requests_for(args, c)} requests (+{warmup_for(args, c)} warmup)")

    runs: list[dict] = []
    failures = 0
    started = time.time()
    interrupted = False
    try:
        for rep in range(args.repeats):
            order = systems if (args.order == "abab" or rep % 2 == 0) else list(reversed(systems))
            for sysname in order:
                tag = f"r{rep}_{sysname}"
                system = System(sysname, args, run_dir, tag)
                log(f"repeat {rep + 1}/{args.repeats}: starting {sysname}")
                try:
                    system.start()
                except Exception as e:  # noqa: BLE001 - report and go on with the other system
                    log(f"{tag}: failed to start: {e}")
                    failures += 1
                    for c in args.concurrency:
                        runs.append({"repeat": rep, "system": sysname, "concurrency": c,
                                     "requests": requests_for(args, c), "ok": False,
                                     "error": f"startup: {e}", "metrics": {}})
                    system.stop()
                    if args.fail_fast:
                        raise FailFast()
                    time.sleep(args.cooldown)
                    continue
                try:
                    for c in args.concurrency:
                        art = run_dir / f"{tag}_c{c}"
                        art.mkdir(exist_ok=True)
                        log(f"{tag}: aiperf concurrency {c}, {requests_for(args, c)} requests")
                        rc, wall = run_aiperf(args, system.base_url, c, art, run_dir / f"{tag}_c{c}_aiperf.log")
                        rec = point_record(rc, wall, art, repeat=rep, system=sysname, concurrency=c,
                                           requests=requests_for(args, c), startup_s=system.startup_s)
                        m = rec["metrics"]
                        if not rec["ok"]:
                            failures += 1
                            log(f"{tag} c={c}: FAILED ({rec['error']}); aiperf log "
                                f"{run_dir / f'{tag}_c{c}_aiperf.log'}:\n"
                                f"{tail(run_dir / f'{tag}_c{c}_aiperf.log', 25)}\n{system.logs_tail(25)}")
                        else:
                            log(f"{tag} c={c}: {m['output_tok_s']:.1f} tok/s, TTFT p50 "
                                f"{m['ttft_p50_ms']:.1f} ms, ITL p50 {m['itl_p50_ms']:.1f} ms ({wall:.0f}s)")
                        runs.append(rec)
                        if not rec["ok"] and args.fail_fast:
                            raise FailFast()
                        if any(not p.alive() for p in system.procs):
                            raise RuntimeError(f"{tag}: a server process died; see its logs:\n"
                                               + system.logs_tail(40))
                except RuntimeError as e:
                    log(str(e))
                    failures += 1
                finally:
                    log(f"{tag}: stopping")
                    system.stop()
                    time.sleep(args.cooldown)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted; writing what was measured so far")
    except FailFast:
        log("--fail-fast: stopping at the first failure")

    summary = summarize(runs, args.concurrency)
    table = markdown(summary, runs, args)
    print(table)
    result = {
        "benchmark": "turbine_frontend_overhead",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "interrupted": interrupted,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": versions(args.python),
        "config": {k: v for k, v in vars(args).items()},
        "engine_flags": engine_flags(args),
        "systems": {"turbine": "python -m turbine.frontend + python -m turbine.vllm",
                    "vllm": "python -m vllm.entrypoints.openai.api_server"},
        "work_dir": str(run_dir),
        "summary": summary,
        "runs": runs,
        "markdown": table,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {out_path}")
    return 1 if failures or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())

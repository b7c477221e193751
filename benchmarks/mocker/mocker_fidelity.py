#!/usr/bin/env python3
r"""Mocker fidelity: does a calibrated `turbine mocker` time requests like the real vLLM CPU worker?

1. Start the real worker (`python -m turbine.vllm --enforce-eager --max-model-len 2048`,
   VLLM_CPU_KVCACHE_SPACE=2) and a Turbine frontend on a private file-discovery folder.
2. Unless --profile is given: `turbine mocker calibrate` against it, writing the profile
   JSON (default benchmarks/results/mocker/mocker_profile-<date>.json).
3. Run the aiperf points (concurrency x input length x shared prefix or not) through the frontend.
4. Stop it; start the frontend + `turbine mocker --block-size 128 --profile <fitted>
   --num-gpu-blocks <the real worker's total blocks>` (also the real worker's max-num-seqs,
   max-num-batched-tokens and max-model-len, read from its model card); run the same points.
Systems alternate per repeat (real, mock, mock, real, ...).  Reported: TTFT p50 and ITL p50 of
both and mock / real per point (target 0.8 .. 1.2), medians over repeats.

  .venv/bin/python -m benchmarks.mocker.mocker_fidelity --repeats 2     # aiperf: make bench-tools, or --aiperf / env AIPERF
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.lib.aiperf import aiperf_point
from benchmarks.lib.paths import REPO_ROOT, default_aiperf, default_model, versions
from benchmarks.lib.proc import log
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.stack import Stack, read_cards, start_turbine
from benchmarks.lib.stats import fmt, median, ratio
from turbine.runtime.ports import free_port


SERVED = "smollm2-135m-instruct"


def parse_points(text: str) -> list[dict]:
    """'C:ISL[:PREFIXLEN[:POOL]]' comma-separated, e.g. 1:128,8:1024,1:128:512:2."""
    points = []
    for item in text.split(","):
        parts = [int(x) for x in item.strip().split(":")]
        c, isl = parts[0], parts[1]
        prefix = parts[2] if len(parts) > 2 else 0
        pool = parts[3] if len(parts) > 3 else 2
        points.append({"concurrency": c, "isl": isl, "prefix_len": prefix, "prefix_pool": pool if prefix else 0,
                       "name": f"c{c}_isl{isl}" + (f"_prefix{prefix}x{pool}" if prefix else "")})
    return points


def total_kv_blocks_from_metrics(system_port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{system_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(r"^turbine_worker_total_kv_blocks\{[^}]*\}\s+([0-9.e+]+)", text, re.M)
    return int(float(m.group(1))) if m else None


def start_real(a, run_dir: Path, tag: str) -> Stack:
    st = Stack("real", run_dir, tag)
    sys_port = free_port()
    st.system_port = sys_port
    start_turbine(st, a.python, ["-m", "turbine.vllm", "--model", a.model, "--served-model-name", SERVED,
                                 "--enforce-eager", "--max-model-len", str(a.max_model_len),
                                 "--system-port", str(sys_port)],
                  worker_env={"VLLM_CPU_KVCACHE_SPACE": str(a.kvcache_space)})
    st.wait_ready(lambda: st.models_ready(SERVED, True), a.startup_timeout)
    st.sanity_check(SERVED)
    return st


def start_mock(a, run_dir: Path, tag: str, engine: dict) -> Stack:
    st = Stack("mock", run_dir, tag)
    argv = ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
            "--block-size", str(engine["kv_block_size"]), "--profile", str(a.profile),
            "--num-gpu-blocks", str(engine["total_kv_blocks"]),
            "--max-num-seqs", str(engine["max_num_seqs"]),
            "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
            "--max-model-len", str(engine["context_length"]),
            "--system-port", str(free_port())]
    st.mock_argv = argv
    start_turbine(st, a.python, argv)
    st.wait_ready(lambda: st.models_ready(SERVED, True), a.startup_timeout)
    st.sanity_check(SERVED)
    return st


def real_engine_config(st: Stack) -> dict:
    cards, _ = read_cards(st.discovery_dir)
    card = next(c for c in cards if c.name == SERVED)
    cfg = {k: getattr(card, k) for k in ("kv_block_size", "total_kv_blocks", "max_num_seqs",
                                         "max_num_batched_tokens", "context_length")}
    cfg["total_kv_blocks_metric"] = total_kv_blocks_from_metrics(st.system_port)
    return cfg


def calibrate(a, st: Stack) -> dict:
    argv = [str(Path(a.python).parent / "turbine"), "mocker", "calibrate", "--model", SERVED,
            "--discovery-backend", "file", "--discovery-dir", st.discovery_dir, "--output", str(a.profile),
            *([] if a.calibrate_direct else ["--url", st.base_url]), *a.calibrate_args.split()]
    log(f"calibrating: {' '.join(argv)}")
    wait_quiet()
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=str(REPO_ROOT))
    (st.run_dir / "calibrate.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise RuntimeError(f"calibrate failed ({r.returncode}):\n{r.stderr[-3000:]}")
    log(f"calibrated in {time.monotonic() - t0:.0f}s:\n{r.stderr}")
    return {"argv": argv, "stderr": r.stderr, "profile": json.loads(Path(a.profile).read_text())}


def run_points(a, st: Stack, rep: int, run_dir: Path) -> list[dict]:
    out = []
    for i, p in enumerate(a.points):
        extra = []
        if p["prefix_len"]:
            extra = ["--num-prefix-prompts", str(p["prefix_pool"]), "--prefix-prompt-length", str(p["prefix_len"])]
        n = a.requests_c1 if p["concurrency"] == 1 else a.requests_per_conc * p["concurrency"]
        wait_quiet()
        tag = f"r{rep}_{st.name}_{p['name']}"
        rec = aiperf_point(aiperf=a.aiperf, url=st.base_url, model=SERVED, tokenizer=a.model,
                           concurrency=p["concurrency"], requests=n, warmup=a.warmup, isl=p["isl"], osl=a.osl,
                           seed=a.seed + i, artifact_dir=run_dir / tag, log_path=run_dir / f"{tag}_aiperf.log",
                           extra=extra, timeout=a.point_timeout)
        rec.update({"repeat": rep, "system": st.name, "point": p["name"], "prefix_len": p["prefix_len"],
                    "prefix_pool": p["prefix_pool"]})
        m = rec["metrics"]
        if rec["ok"]:
            log(f"{tag}: TTFT p50 {m['ttft_p50_ms']:.1f} ms, ITL p50 {m['itl_p50_ms']:.2f} ms, "
                f"{m['output_tok_s']:.1f} tok/s ({rec['wall_s']:.0f}s)")
        out.append(rec)
        if st.any_dead():
            raise RuntimeError(f"{st.tag}: a process died:\n{st.logs_tail()}")
    return out


def summarize(runs: list[dict], points: list[dict]) -> dict:
    summary = {}
    for p in points:
        row = {}
        for sysname in ("real", "mock"):
            ok = [r for r in runs if r["system"] == sysname and r["point"] == p["name"] and r["ok"]]
            row[sysname] = {k: median([r["metrics"][k] for r in ok])
                            for k in ("ttft_p50_ms", "itl_p50_ms", "output_tok_s", "ttft_p99_ms", "itl_p99_ms")}
            row[sysname]["n_ok_runs"] = len(ok)
        row["ttft_ratio"] = ratio(row["mock"]["ttft_p50_ms"], row["real"]["ttft_p50_ms"])
        row["itl_ratio"] = ratio(row["mock"]["itl_p50_ms"], row["real"]["itl_p50_ms"])
        row["tok_s_ratio"] = ratio(row["mock"]["output_tok_s"], row["real"]["output_tok_s"])
        # Per repeat ratios (mock vs the real run of the same repeat).
        per = []
        for rep in sorted({r["repeat"] for r in runs}):
            pair = {r["system"]: r for r in runs if r["repeat"] == rep and r["point"] == p["name"] and r["ok"]}
            if len(pair) == 2:
                per.append({"repeat": rep,
                            "ttft": ratio(pair["mock"]["metrics"]["ttft_p50_ms"], pair["real"]["metrics"]["ttft_p50_ms"]),
                            "itl": ratio(pair["mock"]["metrics"]["itl_p50_ms"], pair["real"]["metrics"]["itl_p50_ms"])})
        row["per_repeat"] = per
        summary[p["name"]] = row
    return summary


def within(r: float | None, tol: float) -> str:
    if r is None:
        return "—"
    return "yes" if abs(r - 1) <= tol else "**no**"


def markdown(summary: dict, points: list[dict], runs: list[dict], a) -> str:
    lines = ["| point | C | ISL | shared prefix | TTFT p50 real (ms) | TTFT p50 mock (ms) | **TTFT mock/real** "
             "| ITL p50 real (ms) | ITL p50 mock (ms) | **ITL mock/real** | within ±20% | tok/s real / mock | runs |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for p in points:
        row = summary[p["name"]]
        r, m = row["real"], row["mock"]
        pref = f"{p['prefix_len']} tok × pool {p['prefix_pool']}" if p["prefix_len"] else "none"
        ok = "TTFT " + within(row["ttft_ratio"], a.tolerance) + ", ITL " + within(row["itl_ratio"], a.tolerance)
        lines.append(f"| {p['name']} | {p['concurrency']} | {p['isl']} | {pref} | {fmt(r['ttft_p50_ms'])} "
                     f"| {fmt(m['ttft_p50_ms'])} | **{fmt(row['ttft_ratio'], 2)}** | {fmt(r['itl_p50_ms'], 2)} "
                     f"| {fmt(m['itl_p50_ms'], 2)} | **{fmt(row['itl_ratio'], 2)}** | {ok} "
                     f"| {fmt(r['output_tok_s'])} / {fmt(m['output_tok_s'])} | {r['n_ok_runs']}/{m['n_ok_runs']} |")
    lines += ["", "Per run:", "", "| repeat | system | point | ok | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tok/s | wall s |",
              "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        m = r.get("metrics") or {}
        lines.append(f"| {r['repeat']} | {r['system']} | {r['point']} | {'yes' if r['ok'] else 'NO'} "
                     f"| {fmt(m.get('ttft_p50_ms'))} | {fmt(m.get('ttft_p99_ms'))} | {fmt(m.get('itl_p50_ms'), 2)} "
                     f"| {fmt(m.get('itl_p99_ms'), 2)} | {fmt(m.get('output_tok_s'))} | {fmt(r.get('wall_s'), 0)} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=default_aiperf(),
                   help="aiperf executable (env AIPERF; default: make bench-tools' .bench-venv/bin/aiperf, else PATH)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`)")
    p.add_argument("--points", type=parse_points,
                   default=parse_points("1:128,8:128,1:1024,8:1024,1:128:512:2,8:128:512:2"),
                   help="C:ISL[:PREFIX_LEN[:PREFIX_POOL]], comma-separated")
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--requests-c1", type=int, default=10, help="measured requests at concurrency 1")
    p.add_argument("--requests-per-conc", type=int, default=4, help="measured requests = this × C (C > 1)")
    p.add_argument("--warmup", type=int, default=0,
                   help="aiperf warmup requests (default 0: aiperf's warmup re-sends measured prompts, which "
                        "would be prefix-cache hits; each stack gets one sanity request first)")
    p.add_argument("--seed", type=int, default=100, help="aiperf seed of the first point (+1 per point)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default=None,
                   help="use this profile instead of calibrating (default: calibrate into "
                        "benchmarks/results/mocker/mocker_profile-<date>.json)")
    p.add_argument("--profile-out", default=None,
                   help="where calibration writes the profile (default benchmarks/results/mocker/mocker_profile-<date>.json)")
    p.add_argument("--calibrate-args", default="", help="extra `turbine mocker calibrate` flags")
    p.add_argument("--calibrate-direct", action="store_true",
                   help="calibrate over the worker's request plane (before 2026-11-26 this was the only way); "
                        "default: through the frontend with a streaming client (`--url`), as aiperf sees the engine")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kvcache-space", default="2")
    p.add_argument("--merge-with", default=None,
                   help="a previous result JSON of the same points: its runs join this run's in the medians "
                        "(this run's repeats are numbered after its)")
    p.add_argument("--tolerance", type=float, default=0.20)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--point-timeout", type=float, default=600)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "mocker" / f"mocker_fidelity-{today}.json"))
    p._today = today
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not a.aiperf:
        parser.error("--aiperf: no aiperf found (env AIPERF, .bench-venv/bin/aiperf, PATH): run `make bench-tools`")
    a.model = a.model or default_model(a.python)
    calibrate_here = a.profile is None
    if calibrate_here:
        a.profile = a.profile_out or str(REPO_ROOT / "benchmarks" / "results" / "mocker" / f"mocker_profile-{parser._today}.json")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-mocker-fidelity-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs under {run_dir}; points: {', '.join(p['name'] for p in a.points)}")

    runs: list[dict] = []
    engine: dict | None = None
    calib: dict | None = None
    mock_argv = None
    started = time.time()
    failures = 0
    try:
        for rep in range(a.repeats):
            order = ["real", "mock"] if rep % 2 == 0 else ["mock", "real"]
            if engine is None:
                order = ["real", "mock"]
            for sysname in order:
                tag = f"r{rep}_{sysname}"
                wait_quiet()
                log(f"repeat {rep + 1}/{a.repeats}: starting {sysname}")
                st = None
                try:
                    if sysname == "real":
                        st = start_real(a, run_dir, tag)
                        engine = engine or real_engine_config(st)
                        log(f"real worker engine: {engine}")
                        if calibrate_here and calib is None:
                            calib = calibrate(a, st)
                    else:
                        st = start_mock(a, run_dir, tag, engine)
                        mock_argv = st.mock_argv
                    runs += run_points(a, st, rep, run_dir)
                except RuntimeError as e:
                    failures += 1
                    log(f"{tag}: {e}")
                finally:
                    if st is not None:
                        log(f"{tag}: stopping")
                        st.stop()
                    time.sleep(3)
    except KeyboardInterrupt:
        log("interrupted; writing what was measured")
        failures += 1

    merged_from = None
    if a.merge_with:
        prev = json.loads(Path(a.merge_with).read_text())
        offset = 1 + max((r["repeat"] for r in prev["runs"]), default=-1)
        for r in runs:
            r["repeat"] += offset
        runs = prev["runs"] + runs
        merged_from = {"path": a.merge_with, "command": prev.get("command"), "date": prev.get("date")}
        engine = engine or prev.get("real_engine")
    summary = summarize(runs, a.points)
    table = markdown(summary, a.points, runs, a)
    print(table)
    failures += sum(1 for r in runs if not r["ok"])
    result = {"benchmark": "turbine_mocker_fidelity", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "versions": versions(a.python), "config": {k: v for k, v in vars(a).items()},
              "real_engine": engine, "calibration": calib, "merged_from": merged_from, "mock_argv": mock_argv,
              "profile": json.loads(Path(a.profile).read_text()) if Path(a.profile).exists() else None,
              "work_dir": str(run_dir), "summary": summary, "runs": runs, "markdown": table}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""aiperf (`make bench-tools`) as the load generator: one run, and its export parsed."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from benchmarks.lib.proc import log, tail


# Environment variables that make aiperf refuse to load a local tokenizer folder.
_AIPERF_ENV_DROP = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    if args.requests_per_point:
        return args.requests_per_point
    return max(args.min_requests, args.requests_multiplier * concurrency)


def warmup_for(args: argparse.Namespace, concurrency: int) -> int:
    if args.warmup_requests is not None:
        return args.warmup_requests
    return max(2, concurrency)


def run_aiperf(args: argparse.Namespace, url: str, concurrency: int, artifact_dir: Path,
               log_path: Path) -> tuple[int, float]:
    n = requests_for(args, concurrency)
    argv = [args.aiperf, "profile",
            "--url", url, "--model", args.served_model_name,
            "--endpoint-type", "chat", "--streaming",
            "--tokenizer", args.tokenizer or args.model,
            "--concurrency", str(concurrency), "--request-count", str(n),
            "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            "--random-seed", str(args.seed),
            "--ui", "none", "--no-gpu-telemetry", "--no-server-metrics",
            "--artifact-dir", str(artifact_dir)]
    if warmup_for(args, concurrency) > 0:  # aiperf rejects 0; leaving the flag out means no warmup
        argv += ["--warmup-request-count", str(warmup_for(args, concurrency))]
    if args.use_server_token_count:
        argv.append("--use-server-token-count")
    if args.aiperf_workers:
        argv += ["--workers-max", str(args.aiperf_workers)]
    argv += shlex.split(args.aiperf_args)
    env = {k: v for k, v in os.environ.items() if k not in _AIPERF_ENV_DROP}
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        out.write(f"$ {shlex.join(argv)}\n".encode())
        out.flush()
        try:
            rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(artifact_dir.parent),
                                timeout=args.point_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def find_export(artifact_dir: Path) -> Path | None:
    hits = sorted(artifact_dir.rglob("profile_export_aiperf.json"))
    if not hits:
        hits = sorted(p for p in artifact_dir.rglob("*aiperf*.json") if "raw" not in p.name)
    return hits[0] if hits else None


def _metric(data: dict, name: str) -> dict:
    """aiperf's summary JSON keeps each metric as {"unit", "avg", "p50", "p99", ...}, at the top
    level or under "records" / "metrics" depending on the version."""
    for container in (data, data.get("records") or {}, data.get("metrics") or {}):
        if isinstance(container, dict) and isinstance(container.get(name), dict):
            return container[name]
        if isinstance(container, list):
            for m in container:
                if isinstance(m, dict) and m.get("tag") == name:
                    return m
    return {}


def _stat(metric: dict, key: str) -> float | None:
    v = metric.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def parse_export(path: Path) -> dict:
    data = json.loads(path.read_text())
    ttft, itl = _metric(data, "time_to_first_token"), _metric(data, "inter_token_latency")
    thr = _metric(data, "output_token_throughput")
    req_thr = _metric(data, "request_throughput")
    count = _metric(data, "request_count")
    errors = _metric(data, "error_request_count")
    osl = _metric(data, "output_sequence_length")
    out = {
        "output_tok_s": _stat(thr, "avg"),
        "request_per_s": _stat(req_thr, "avg"),
        "ttft_p50_ms": _stat(ttft, "p50"), "ttft_p99_ms": _stat(ttft, "p99"), "ttft_avg_ms": _stat(ttft, "avg"),
        "itl_p50_ms": _stat(itl, "p50"), "itl_p99_ms": _stat(itl, "p99"), "itl_avg_ms": _stat(itl, "avg"),
        "osl_avg": _stat(osl, "avg"),
        "requests": _stat(count, "avg"),
        "errors": _stat(errors, "avg") or 0.0,
        "units": {"ttft": ttft.get("unit"), "itl": itl.get("unit"), "throughput": thr.get("unit")},
    }
    # Normalise latencies to milliseconds if aiperf reported another unit.
    for key, unit in (("ttft", ttft.get("unit")), ("itl", itl.get("unit"))):
        scale = {"s": 1e3, "sec": 1e3, "us": 1e-3, "ns": 1e-6}.get((unit or "ms").lower(), 1.0)
        if scale != 1.0:
            for stat in ("p50", "p99", "avg"):
                k = f"{key}_{stat}_ms"
                if out[k] is not None:
                    out[k] *= scale
    if "error_summary" in data and data["error_summary"]:
        out["error_summary"] = data["error_summary"]
    return out


def aiperf_point(*, aiperf: str, url: str, model: str, tokenizer: str, concurrency: int, requests: int,
                 warmup: int, isl: int, osl: int, seed: int, artifact_dir: Path, log_path: Path,
                 extra: list[str] | None = None, timeout: float = 900) -> dict:
    """One aiperf run with frontend_overhead's load (streaming chat, fixed ISL/OSL, ignore_eos,
    output tokens from the server's usage) plus `extra` aiperf flags.  Returns a record with the
    parsed metrics and ok / error."""
    ns = argparse.Namespace(
        aiperf=aiperf, served_model_name=model, tokenizer=tokenizer, model=tokenizer,
        requests_per_point=requests, min_requests=requests, requests_multiplier=1,
        warmup_requests=warmup, isl=isl, osl=osl, seed=seed, use_server_token_count=True,
        aiperf_workers=0, aiperf_args=shlex.join(extra or []), point_timeout=timeout)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    rc, wall = run_aiperf(ns, url, concurrency, artifact_dir, log_path)
    rec = point_record(rc, wall, artifact_dir, concurrency=concurrency, requests=requests, warmup=warmup, isl=isl,
                       osl=osl, seed=seed, extra=extra or [])
    if not rec["ok"]:
        log(f"aiperf FAILED ({rec['error']}); log {log_path}:\n{tail(log_path, 25)}")
    return rec


def point_record(rc: int, wall: float, artifact_dir: Path, **fields) -> dict:
    """One aiperf run's record: `fields`, its exit code and wall time, the parsed export, and `ok` (exit 0, a
    throughput, no failed request) or else `error`."""
    export = find_export(artifact_dir)
    rec = {**fields, "aiperf_rc": rc, "wall_s": wall, "artifact_dir": str(artifact_dir),
           "export": str(export) if export else None, "metrics": {}}
    if export:
        try:
            rec["metrics"] = parse_export(export)
        except (OSError, ValueError) as e:
            rec["error"] = f"cannot parse {export}: {e}"
    m = rec["metrics"]
    rec["ok"] = rc == 0 and m.get("output_tok_s") is not None and not m.get("errors")
    if not rec["ok"]:
        rec.setdefault("error", f"aiperf rc={rc}, errors={m.get('errors')}")
    return rec

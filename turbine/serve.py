"""`turbine serve`: one frontend + one vLLM worker on this machine (or, with --disagg, one
prefill and one decode worker joined by NIXL), file discovery in a private directory,
Ctrl-C stops them all cleanly."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from turbine.logging_setup import add_logging_args, logging_choices
from turbine.model.prepare import DEFAULT_MODEL, EMBEDDED_MODELS, resolve
from turbine.tracing import add_tracing_args

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 40


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turbine serve",
        description="Serve a model with one frontend and one vLLM worker. Flags not listed here "
                    "are passed to the worker (any vLLM engine flag, e.g. --max-model-len 4096).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded model name, local Hugging Face folder or hub id (default {DEFAULT_MODEL})")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TURBINE_API_KEY"))
    p.add_argument("--cluster-key", default=None,
                   help="cluster key of the internal planes, given to the frontend and the worker(s) through "
                        "their environment (TURBINE_CLUSTER_KEY, which also works here)")
    p.add_argument("--cluster-key-file", default=None,
                   help="file holding the cluster key (TURBINE_CLUSTER_KEY_FILE, which also works here)")
    p.add_argument("--router-mode", default="round-robin")
    # Observability for every child: through their environment (TURBINE_LOG_LEVEL, TURBINE_LOG_FORMAT,
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), so that the frontend gets them too and vLLM's own parser
    # (whose --log-level takes upper case only) never sees ours.
    add_logging_args(p)
    add_tracing_args(p)
    p.add_argument("--disagg", action="store_true",
                   help="disaggregated serving: a prefill worker and a decode worker, the prompt's KV moved "
                        "between them by NIXL (--connector nixl unless you give --connector or "
                        "--kv-transfer-config)")
    return p


def _wait_ready(url: str, model: str, procs: list[subprocess.Popen], prefill: bool = False) -> bool:
    """Until the frontend serves the model (and, disaggregated, has its prefill worker too)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                health = json.load(resp)
                if model in health.get("models", {}) and (not prefill or model in health.get("prefill_workers", {})):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, worker_args = parser.parse_known_args(argv)
    if not 0 < args.http_port <= 65535:
        parser.error(f"--http-port {args.http_port}: must be between 1 and 65535")
    model_path = resolve(args.model)  # prepare the embedded model here, with visible progress
    # The same default the worker applies: the embedded model's name, else the model as given.
    name = _served_name(worker_args) or (args.model if args.model in EMBEDDED_MODELS else model_path)
    env = dict(os.environ)
    env["TURBINE_DISCOVERY_BACKEND"] = "file"
    env["TURBINE_DISCOVERY_DIR"] = tempfile.mkdtemp(prefix="turbine-serve-")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is sized for servers
    env.update(cluster_key_env(args, parser))
    env.update(observability_env(argv, args))

    worker_cmd = [sys.executable, "-m", "turbine.vllm", "--model", args.model, *worker_args]
    if args.disagg:
        if not any(a.split("=")[0] in ("--connector", "--kv-transfer-config") for a in worker_args):
            worker_cmd += ["--connector", "nixl"]
        worker_cmds = [worker_cmd + ["--disaggregation-mode", "prefill"],
                       worker_cmd + ["--disaggregation-mode", "decode"]]
        worker_envs = [dict(env, **cpus) for cpus in split_cpu_cores(env)]
    else:
        worker_cmds, worker_envs = [worker_cmd], [env]
    # Each worker's status server (/metrics with vLLM's own metrics, /health): after the HTTP port
    # unless the worker flags or TURBINE_SYSTEM_PORT name one (printed below, for Prometheus).
    status_ports = []
    if _flag_value(worker_args, "--system-port") is None and "TURBINE_SYSTEM_PORT" not in env:
        for cmd in worker_cmds:
            port = free_port_from(args.http_port + 1 + len(status_ports))
            cmd += ["--system-port", str(port)]
            status_ports.append(port)
    elif (given := _flag_value(worker_args, "--system-port") or env.get("TURBINE_SYSTEM_PORT")) and not args.disagg:
        status_ports.append(int(given))
    frontend_cmd = [sys.executable, "-m", "turbine.frontend", "--http-host", args.http_host,
                    "--http-port", str(args.http_port), "--router-mode", args.router_mode]
    if args.api_key:
        env["TURBINE_API_KEY"] = args.api_key

    # Children ignore Ctrl-C from the terminal; we stop them in order with SIGTERM. A service
    # manager's SIGTERM does the same as Ctrl-C (by default it would end only this process and
    # leave the engines running).
    signal.signal(signal.SIGTERM, _interrupt)
    procs = [subprocess.Popen(frontend_cmd, env=env, preexec_fn=os.setpgrp),
             *(subprocess.Popen(cmd, env=wenv, preexec_fn=os.setpgrp) for cmd, wenv in zip(worker_cmds, worker_envs))]
    url = f"http://{args.http_host}:{args.http_port}"
    try:
        what = "a prefill and a decode worker" if args.disagg else "worker"
        print(f"[turbine] starting {what} for {name!r} (an engine takes 30 s to a few minutes on a small CPU; the first start compiles)…", flush=True)
        if not _wait_ready(url, name, procs, prefill=args.disagg):
            print("[turbine] failed to start; see the logs above", file=sys.stderr)
            return 1
        print(f"[turbine] ready: OpenAI API at {url}/v1  (model {name!r}); Ctrl-C to stop", flush=True)
        workers_at = ", ".join(f"http://127.0.0.1:{port}/metrics" for port in status_ports) or "off"
        print(f"[turbine] metrics: frontend {url}/metrics; worker (Turbine's and vLLM's) {workers_at}", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("[turbine] a process exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[turbine] stopping…", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stop short
        _stop(procs[::-1])  # workers first (they drain), then the frontend


def cluster_key_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, str]:
    """The cluster key flags as environment for every child (a flag would reach the worker only,
    and the environment keeps the key out of `ps`)."""
    if args.cluster_key and args.cluster_key_file:
        parser.error("give the key once: --cluster-key or --cluster-key-file, not both")
    if args.cluster_key:
        return {"TURBINE_CLUSTER_KEY": args.cluster_key}
    if args.cluster_key_file:
        return {"TURBINE_CLUSTER_KEY_FILE": os.path.abspath(args.cluster_key_file)}
    return {}


def observability_env(argv: list[str], args: argparse.Namespace) -> dict[str, str]:
    """The logging and tracing flags as environment for every child (flag, else environment, else default)."""
    level, fmt = logging_choices(argv, "turbine serve")
    env = {"TURBINE_LOG_LEVEL": level, "TURBINE_LOG_FORMAT": fmt}
    if args.otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_traces_endpoint
    return env


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _served_name(worker_args: list[str]) -> str | None:
    return _flag_value(worker_args, "--served-model-name")


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def free_port_from(port: int) -> int:
    """`port` if nothing listens on it on loopback, else the next free one."""
    import socket

    for candidate in range(port, min(port + 100, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise SystemExit(f"turbine serve: no free port from {port} for the worker's status server (give --system-port)")


def split_cpu_cores(env: dict) -> list[dict]:
    """With the CPU engine, the prefill and the decode worker each get half of this machine's
    cores for their compute threads. Sharing all of them, each engine's threads wait on the
    other's at every step (and an engine that waits on a KV transfer polls without sleeping):
    on 2 cores the pair ran several times slower. A binding the user set is kept."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return [{}, {}]  # a GPU build: each engine has its own device
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" in env or len(cores) < 2:
        return [{}, {}]
    half = len(cores) // 2
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, part))} for part in (cores[:half], cores[half:])]

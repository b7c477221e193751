"""Helpers shared by the benchmarks of issue #3 (mocker fidelity, frontend ceiling, mocker scale).

The process handling, aiperf invocation and aiperf-export parsing are the ones of
`frontend_overhead.py` (imported from it, not copied); this module adds what the new
benchmarks need beyond them: a Turbine stack with any worker command, a generic aiperf point,
the quiet-machine check, reading model cards from file discovery, and CPU-time accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frontend_overhead import (  # noqa: E402  (re-exported for the other benchmarks)
    REPO_ROOT,
    Proc,
    default_aiperf,
    default_dynamo_python,
    default_model,
    find_export,
    fmt,
    free_port,
    http_get_json,
    http_post_json,
    log,
    median,
    parse_export,
    parse_int_list,
    run_aiperf,
    shared_path,
    tail,
    versions,
)

__all__ = ["REPO_ROOT", "Proc", "start_nats", "default_aiperf", "default_dynamo_python", "shared_path", "default_model", "find_export", "fmt", "free_port", "http_get_json",
           "http_post_json", "log", "median", "parse_export", "parse_int_list", "run_aiperf", "tail",
           "versions", "Stack", "aiperf_point", "wait_quiet", "read_cards", "proc_cpu_s", "ratio",
           "StreamError", "sse_chunks", "record_usage", "checkout_env", "turbine_origin"]


class StreamError(Exception):
    """An OpenAI streaming response that failed: an HTTP error, or an error chunk."""


async def sse_chunks(client, url: str, body: dict):
    """The JSON chunks of one OpenAI streaming response (httpx client), up to [DONE]."""
    import json

    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()  # "data: x" or "data:x": both are SSE
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(str(chunk["error"])[:300])
            yield chunk


def record_usage(rec: dict, chunk: dict) -> None:
    """Copies a chunk's usage (prompt, completion and cached tokens) into a request record."""
    usage = chunk.get("usage")
    if usage:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["completion_tokens"] = usage.get("completion_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------- quiet machine
def wait_quiet(poll_s: float = 20.0, max_wait_s: float = 3600.0) -> float:
    """Block while a `pytest` process runs (the lead's CI pass shares the 2 cores); return the
    seconds waited.  Measurements must not overlap it."""
    if os.environ.get("BENCH_SKIP_QUIET_CHECK") == "1":  # smoke tests only, never for measurements
        return 0.0
    waited = 0.0
    while waited < max_wait_s:
        r = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True)
        pids = [p for p in r.stdout.split() if p.strip() and int(p) != os.getpid() and _is_pytest(int(p))]
        if not pids:
            return waited
        if waited == 0:
            log(f"pytest is running (pids {' '.join(pids)}): waiting for a quiet machine")
        time.sleep(poll_s)
        waited += poll_s
    raise RuntimeError(f"pytest still running after {max_wait_s:.0f}s")


def _is_pytest(pid: int) -> bool:
    """A pytest run itself (`pytest ...`, `python -m pytest ...`), not a process that merely has
    "pytest" in an argument (e.g. a leftover test worker given a /tmp/pytest-of-root/... path)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    argv = [x.decode(errors="replace") for x in argv if x]
    if not argv or os.path.basename(argv[0]) == "flock":
        return False  # `flock LOCK pytest ...` waits for the engine lock (maybe ours): not running yet
    if os.path.basename(argv[0]).startswith(("pytest", "py.test")):
        return True
    if len(argv) > 1 and os.path.basename(argv[1]).startswith(("pytest", "py.test")):
        return True  # python /path/to/pytest ...
    return any(a == "-m" and b == "pytest" for a, b in zip(argv, argv[1:]))


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# --------------------------------------------------------------------------- stacks
class Stack:
    """Processes of one serving stack (started in order, stopped in reverse), an HTTP base URL,
    and a readiness check."""

    def __init__(self, name: str, run_dir: Path, tag: str, port: int | None = None):
        self.name, self.run_dir, self.tag = name, run_dir, tag
        self.procs: list[Proc] = []
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_s: float | None = None
        self._t0 = time.monotonic()

    def spawn(self, what: str, argv: list[str], env: dict[str, str]) -> Proc:
        env = dict(env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        p = Proc(f"{self.tag} {what}", argv, env, self.run_dir / f"{self.tag}_{what}.log")
        self.procs.append(p)
        return p

    def wait_ready(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited with code {p.popen.returncode} during startup; "
                                       f"log {p.log_path}:\n{tail(p.log_path)}")
            try:
                if ready():
                    self.startup_s = time.monotonic() - self._t0
                    log(f"{self.tag}: ready at {self.base_url} after {self.startup_s:.0f}s")
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.tag} not ready after {timeout:.0f}s; logs: "
                           + ", ".join(str(p.log_path) for p in self.procs))

    def models_ready(self, model: str, turbine: bool) -> bool:
        status, body = http_get_json(f"{self.base_url}/health")
        if turbine:
            return status == 200 and isinstance(body, dict) and model in (body.get("models") or {})
        status, body = http_get_json(f"{self.base_url}/v1/models")
        return status == 200 and isinstance(body, dict) and any(
            m.get("id") == model for m in body.get("data") or [])

    def sanity_check(self, model: str) -> None:
        status, body = http_post_json(f"{self.base_url}/v1/chat/completions", {
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]})
        if status != 200:
            raise RuntimeError(f"{self.tag}: sanity chat request got HTTP {status}: {body}")

    def stop(self, timeout: float = 60) -> None:
        for p in reversed(self.procs):
            p.stop(timeout)
        self.procs.clear()

    def any_dead(self) -> bool:
        return any(not p.alive() for p in self.procs)

    def logs_tail(self, n: int = 30) -> str:
        return "\n".join(f"--- {p.log_path} ---\n{tail(p.log_path, n)}" for p in self.procs)


def start_nats(stack: Stack, timeout: float = 15.0) -> str:
    """A private nats-server (Debian's nats-server) as one of `stack`'s processes, so its CPU is recorded
    with the stack's and it stops with it; returns its URL for TURBINE_NATS_SERVER."""
    import shutil
    import socket

    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server not found: apt-get install -y nats-server")
    port = free_port()
    stack.spawn("nats", [binary, "-a", "127.0.0.1", "-p", str(port)], dict(os.environ))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                if conn.recv(4) == b"INFO":
                    return f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nats-server did not start on port {port}")


def turbine_env(discovery_dir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TURBINE_DISCOVERY_DIR=discovery_dir, TURBINE_DISCOVERY_BACKEND="file",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def start_turbine(stack: Stack, python: str, worker_argv: list[str], worker_env: dict[str, str] | None = None,
                  frontend_args: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """A Turbine frontend plus one worker process (vLLM or mocker) sharing a private file
    discovery folder; returns that folder.  The caller waits for readiness.  `env` goes to both
    processes (e.g. `checkout_env(path)` to run another Turbine checkout)."""
    disc = tempfile.mkdtemp(prefix="discovery_", dir=stack.run_dir)
    stack.discovery_dir = disc
    stack.spawn("worker", [python, *worker_argv], turbine_env(disc, **(env or {}), **(worker_env or {})))
    stack.spawn("frontend", [python, "-m", "turbine.frontend", "--http-port", str(stack.port),
                             *(frontend_args or [])], turbine_env(disc, **(env or {})))
    return disc


def checkout_env(checkout: str | Path) -> dict[str, str]:
    """Environment that makes Turbine's python import `turbine` from another checkout (same venv).
    PYTHONPATH alone is not enough: the processes run with the current directory in this repo, and
    `python -m` / `-c` put that directory first on sys.path, ahead of PYTHONPATH; PYTHONSAFEPATH=1
    (Python >= 3.11) leaves it out.  The editable install's finder comes after both."""
    path = str(Path(checkout).resolve())
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path + (os.pathsep + rest if rest else ""), "PYTHONSAFEPATH": "1"}


def turbine_origin(python: str, env: dict[str, str] | None = None) -> dict[str, str | None]:
    """Where `turbine` is imported from under this python and environment (as the stack's processes
    run: current directory REPO_ROOT), and that checkout's git commit."""
    code = "import os, turbine; print(os.path.dirname(os.path.dirname(os.path.abspath(turbine.__file__))))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=str(REPO_ROOT),
                       env=dict(os.environ, **(env or {})), timeout=120)
    root = r.stdout.strip() or None
    commit = None
    if root:
        g = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = g.stdout.strip() or None
        d = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
        if d.returncode == 0 and d.stdout.strip() and commit:
            commit += "+dirty"
    return {"root": root, "commit": commit, "error": r.stderr.strip()[-500:] if r.returncode else None}


async def _read_cards(discovery_dir: str):
    from turbine.config import DiscoveryConfig, make_registry
    registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
    await registry.backend.start()
    try:
        return await registry.list_models(), await registry.list_instances()
    finally:
        await registry.backend.close()


def read_cards(discovery_dir: str):
    """(model cards, instance records) currently in a file-discovery folder."""
    return asyncio.run(_read_cards(discovery_dir))


# --------------------------------------------------------------------------- aiperf
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
    export = find_export(artifact_dir)
    rec = {"concurrency": concurrency, "requests": requests, "warmup": warmup, "isl": isl, "osl": osl,
           "seed": seed, "extra": extra or [], "aiperf_rc": rc, "wall_s": wall,
           "artifact_dir": str(artifact_dir), "export": str(export) if export else None, "metrics": {}}
    if export:
        try:
            rec["metrics"] = parse_export(export)
        except (OSError, ValueError) as e:
            rec["error"] = f"cannot parse {export}: {e}"
    m = rec["metrics"]
    rec["ok"] = rc == 0 and m.get("output_tok_s") is not None and not m.get("errors")
    if not rec["ok"]:
        rec.setdefault("error", f"aiperf rc={rc}, errors={m.get('errors')}")
        log(f"aiperf FAILED ({rec['error']}); log {log_path}:\n{tail(log_path, 25)}")
    return rec

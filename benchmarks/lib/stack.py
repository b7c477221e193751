"""A serving stack of a benchmark: its processes (started in order, stopped in reverse), a Turbine frontend and
worker on a private file-discovery folder, a private NATS server, another checkout's Turbine, and the model
cards the stack registered."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import urllib.error
from pathlib import Path

from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import Proc, http_get_json, http_post_json, log, tail
from turbine.runtime.ports import free_port  # below the ephemeral range: no bind race


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

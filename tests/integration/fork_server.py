"""A fork server for the tests' vLLM workers: a process that has imported Turbine's vLLM worker once and forks
each `python -m turbine.vllm ...` the tests start from itself.

Why: on the 2-core CI host, importing the worker (vLLM, torch, transformers) is ~12 s of CPU, about 70 % of a
`uni` engine's start (16.7 s to ready, 2026-12-01; docs/operations/tests.md), and the suite starts dozens of
workers. A forked worker runs the same `main` with the same argv and environment; only the imports are shared.

What a forked worker keeps of a started one, and how:
- argv, environment, working directory, its log file as stdout and stderr, stdin from /dev/null; `__main__` is
  `turbine.vllm.__main__`, run as `python -m` runs it (runpy), so vLLM's spawned processes find it.
- Its exit status: the server is its parent and reaps it, and sends `{"exit": pid, "code": ...}` back;
  `ForkedProcess` answers `poll`/`wait`/`returncode` as `subprocess.Popen` does (minus signal number).
- Its title in `ps` is that command line (setproctitle), so that its processes (and vLLM's titles such as
  `VLLM::EngineCore` for the engine core) are told apart as before.
- Python's `random` and numpy's global generator are reseeded (a fork shares its parent's state).
- The environment that imports see: one server per distinct environment, apart from the variables read at
  run time only (`RUNTIME_ONLY`), so nothing that an import reads from the environment differs from a fresh start.
The messages are JSON lines over a socket pair: nothing is unpickled. The CPU build only: a GPU's vLLM is left to
start as users start it (`TURBINE_TEST_FORK_SERVER=0` turns the server off here too).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

# Read when the worker runs, never at import (Turbine reads no environment at import; vLLM's `envs` is lazy).
# PYTEST_CURRENT_TEST is pytest's name of the running test, in every environment the tests copy from theirs: as
# part of the key it gave each module a server of its own (12 servers' imports in one run, ~11 s of CPU each).
RUNTIME_ONLY_PREFIXES = ("TURBINE_",)
RUNTIME_ONLY = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_HOST_IP", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"}
MAX_SERVERS = 2  # each holds ~1 GiB of imports; environments beyond two are rare (mp layout, one module's own)


def _import_env(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in RUNTIME_ONLY and not k.startswith(RUNTIME_ONLY_PREFIXES)))


# -- the server's side --------------------------------------------------------------------------------------
def serve(fd: int) -> dict | None:
    """The server's loop. Returns only in a forked child, with the request it is to run."""
    start_env = dict(os.environ)
    import setproctitle  # (vLLM's dependency) first set while the environment is as the process found it:
    setproctitle.setproctitle("turbine tests' fork server")  # later, after a child's os.environ.clear(), it still can
    import turbine.vllm.worker  # noqa: F401  (the ~12 s this process is for)
    imported_env = {k: v for k, v in os.environ.items() if start_env.get(k) != v}  # what imports set (vLLM does)
    sock = socket.socket(fileno=fd)
    sock.sendall(b'{"ready": true}\n')
    buf = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if not readable:
            continue
        data = sock.recv(1 << 20)
        if not data:
            return None  # the test process is gone; the workers it started are its fixtures' to stop
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                req["imported_env"] = imported_env
                return req
            children.add(pid)
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def run_child(req: dict) -> None:
    """In the forked child: become `python -m MODULE ARGS` as `subprocess.Popen` would have started it."""
    import random
    import runpy

    import setproctitle
    setproctitle.setproctitle(" ".join([sys.executable, "-m", req["module"], *req["args"]]))  # what `ps` shows
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in req["imported_env"].items():
        os.environ.setdefault(k, v)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [req["module"], *req["args"]]
    runpy._run_module_as_main(req["module"])  # what `python -m` calls: __main__ is the module, argv[0] its path


# -- the tests' side ----------------------------------------------------------------------------------------
class _Server:
    def __init__(self, env: dict, log: str):
        ours, theirs = socket.socketpair()
        with open(log, "wb") as out:  # its own import warnings; what it would print on failing to start
            self.popen = subprocess.Popen(
                [sys.executable, "-c", "from tests.integration.fork_server import serve, run_child\n"
                 f"req = serve({theirs.fileno()})\nif req is not None: run_child(req)"],
                env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=os.getcwd())
        theirs.close()
        self.log = log
        self.sock = ours
        self.lock = threading.Lock()  # one request at a time
        self.replies: queue.Queue = queue.Queue()
        self.procs: dict[int, ForkedProcess] = {}
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="fork-server-reader").start()
        ready = self.replies.get(timeout=300)
        if not ready.get("ready"):
            with open(log, errors="replace") as f:
                raise RuntimeError(f"fork server did not start: {ready}\n{f.read()[-3000:]}")

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self.alive = False
                self.replies.put({"gone": True})
                for proc in list(self.procs.values()):
                    proc._server_gone()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "exit" in msg:
                    proc = self.procs.pop(msg["exit"], None)
                    if proc is not None:
                        proc._exited(msg["code"])
                else:
                    self.replies.put(msg)

    def start(self, module: str, args: list[str], env: dict, log: str) -> ForkedProcess:
        with self.lock:
            self.sock.sendall(json.dumps({"module": module, "args": args, "env": env, "log": log,
                                          "cwd": os.getcwd()}).encode() + b"\n")
            reply = self.replies.get(timeout=60)
            if "pid" not in reply:
                raise RuntimeError(f"fork server could not start {module}: {reply}")
            proc = ForkedProcess(reply["pid"])
            self.procs[proc.pid] = proc
            if not self.alive:  # it died between the fork and now: nobody will report this child's exit
                proc._server_gone()
            return proc

    def close(self) -> None:
        self.sock.close()  # the server returns from its loop and exits
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()


class ForkedProcess:
    """What the tests use of `subprocess.Popen`, for a worker the fork server started (its parent is the
    server, which reports its exit)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def _server_gone(self) -> None:
        # Its parent died: the child was handed to init, which reaps it. Only whether it still runs is known.
        def watch():
            while _pid_running(self.pid):
                time.sleep(0.2)
            if self.returncode is None:
                self._exited(-signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def start(module: str, args: list[str], env: dict, log: str) -> ForkedProcess:
    """`python -m MODULE ARGS` with `env`, stdout and stderr to `log`, forked from a server of that environment."""
    key = _import_env(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            if len(_servers) >= MAX_SERVERS:
                _servers.pop(next(iter(_servers))).close()  # the oldest
            server = _servers[key] = _Server(env, f"{os.path.dirname(log)}/fork-server-{os.getpid()}.log")
        else:
            _servers[key] = _servers.pop(key)  # most recently used last
    return server.start(module, args, env, log)


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()

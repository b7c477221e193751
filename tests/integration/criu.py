"""CRIU for the tests and benchmarks: the binary scripts/build_criu.sh builds once into a cache
(Debian bookworm's criu 3.17.1 cannot start on this kernel), and the dump / restore flags a vLLM
worker needs here (docs/benchmarks/lifecycle.md "Checkpoint / restore" says why each one)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
# Established loopback TCP (vLLM's ZMQ sockets), external unix sockets, no iptables here to lock the
# network with, deleted POSIX semaphores in /dev/shm (torch), file locks.
FLAGS = ["--tcp-established", "--ext-unix-sk", "--network-lock", "skip", "--link-remap", "--file-locks"]


def build() -> str:
    """The cached CRIU binary, built first if need be (~1-2.5 min once: apt-get of its build libraries,
    Debian's source tarball, make). RuntimeError with the build's output if it fails."""
    out = subprocess.run(["bash", str(REPO / "scripts/build_criu.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build_criu.sh failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def check(criu: str) -> str | None:
    """None when `criu check` passes on this kernel, else what it said."""
    out = subprocess.run([criu, "check"], capture_output=True, text=True)
    return None if out.returncode == 0 else (out.stdout + out.stderr).strip()


# A dump that met a unix socket whose peer was, that instant, most likely a closed connection not yet taken off
# a listener's queue (vLLM's ZMQ sockets inside the tree): CRIU refuses it and leaves the tree running; a moment
# later the listener's I/O thread has taken it. Seen once in a CI run beside other engines on two cores (2026-12-01).
TRANSIENT = "closed in-flight socket"


def dump(criu: str, pid: int, images: Path, attempts: int = 2) -> subprocess.CompletedProcess:
    """Dump the process tree of `pid` into `images` (which ends it); returns once every process of the
    tree is gone (the caller reaps `pid` itself if it is its child): a restore takes their pids back.
    A dump refused for TRANSIENT is tried again after a second, as an operator would (the first
    refusal's log kept as dump-refused.log); any other failure is returned at once."""
    images.mkdir(parents=True, exist_ok=True)
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for attempt in range(attempts):
        out = subprocess.run([criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4", *FLAGS],
                             capture_output=True, text=True)
        if out.returncode == 0:
            psutil.wait_procs([p for p in tree if p.pid != pid], timeout=30)
            return out
        log = images / "dump.log"
        if attempt + 1 == attempts or TRANSIENT not in log.read_text(errors="replace"):
            return out
        log.rename(images / "dump-refused.log")
        for f in images.iterdir():  # the refused attempt's partial images
            if f.name != "dump-refused.log":
                f.unlink()
        time.sleep(1.0)
    return out


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Until no process has one of `pids` (a zombie still holds its pid until reaped)."""
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def restore(criu: str, images: Path) -> int:
    """Restore the tree detached (`-d`); its root's pid. RuntimeError with the log's tail if it fails."""
    pidfile = images / "restored.pid"
    out = subprocess.run([criu, "restore", "-D", str(images), "-d", "-o", "restore.log", "-v4", *FLAGS,
                          "--pidfile", str(pidfile)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"criu restore failed ({out.returncode}):\n{log_tail(images / 'restore.log')}")
    return int(pidfile.read_text())


def log_tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if "Error" in line]
    return "\n".join(errors[-10:] + ["..."] + lines[-n:])

"""Child processes of a benchmark (each in its own process group, logging to a file), logging, and small
HTTP helpers."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.lib.paths import REPO_ROOT


def exit_on_sigterm() -> None:
    """A SIGTERM (a `timeout`, someone's cleanup) unwinds like Ctrl-C, so `finally` blocks stop the servers a
    benchmark started instead of leaving them on the machine."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http_get_json(url: str, timeout: float = 3.0) -> tuple[int, object]:
    return _json_exchange(url, timeout)


def http_post_json(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, object]:
    return _json_exchange(urllib.request.Request(url, data=json.dumps(payload).encode(),
                                                 headers={"Content-Type": "application/json"}, method="POST"), timeout)


def _json_exchange(req, timeout: float) -> tuple[int, object]:
    """(HTTP status, the JSON body, or its text when it is not JSON); an HTTP error status is an answer too."""
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


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None

"""The quiet-host check: measurements wait while a pytest run shares the cores."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from benchmarks.lib.proc import log


def wait_quiet(poll_s: float = 20.0, max_wait_s: float = 3600.0) -> float:
    """Block while a `pytest` process runs (the lead's CI pass shares the 2 cores); return the
    seconds waited.  Measurements must not overlap it."""
    if os.environ.get("BENCH_SKIP_QUIET_CHECK") == "1":  # smoke tests only, never for measurements
        return 0.0
    waited = 0.0
    while waited < max_wait_s:
        r = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True)
        pids = [p for p in r.stdout.split() if p.strip() and int(p) != os.getpid() and is_pytest(int(p))]
        if not pids:
            return waited
        if waited == 0:
            log(f"pytest is running (pids {' '.join(pids)}): waiting for a quiet machine")
        time.sleep(poll_s)
        waited += poll_s
    raise RuntimeError(f"pytest still running after {max_wait_s:.0f}s")


def is_pytest(pid: int) -> bool:
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

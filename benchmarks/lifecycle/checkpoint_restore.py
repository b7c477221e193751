"""Checkpoint / restore of a simulated worker (issue #15 §4): cold start vs restore to ready.

Three ways to get a ready worker (GET /health = 200), each timed from its trigger:
- cold: start `python -m turbine.mocker` normally (import, build, sockets, register, canary);
- marker: a checkpoint-mode worker held at ready-for-checkpoint is told restore-complete (the
  warm half alone: wake, sockets, register, canary; no process image involved);
- criu: a checkpoint-mode worker at ready-for-checkpoint is dumped with `criu dump` (which ends
  it), then `criu restore -d` brings it back and restore-complete is written: timed from the
  restore command to /health 200. Only where `criu check` passes; otherwise its error is printed.

    .venv/bin/python -m benchmarks.lifecycle.checkpoint_restore --repeats 3 [--criu /path/to/criu]

Rounds alternate the order (cold, marker, criu / criu, marker, cold); medians are reported
(seconds; criu_image_mb: the dump's size). Checkpoint-mode mockers run on asyncio, not uvloop:
uvloop's libuv maps io_uring rings, which CRIU cannot dump.
Other helpers load this 2-core machine: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.lib.paths import REPO_ROOT


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_for(cond, timeout: float, what: str) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if cond():
            return time.perf_counter()
        time.sleep(0.01)
    raise TimeoutError(what)


def mocker(root: Path, port: int, control: Path | None) -> subprocess.Popen:
    env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", TURBINE_DISCOVERY_DIR=str(root / "discovery"),
               PYTHONUNBUFFERED="1")
    if control is not None:
        env["TURBINE_SNAPSHOT_CONTROL_DIR"] = str(control)
    log = open(root / f"mocker-{port}.log", "wb")
    # Its own session, stdin from /dev/null: a process tree CRIU can dump without --shell-job.
    return subprocess.Popen([sys.executable, "-m", "turbine.mocker", "--system-port", str(port),
                             "--speedup-ratio", "0"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT)


def stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def cold(root: Path) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = mocker(root, port, None)
    try:
        return wait_for(lambda: healthy(port), 120, "cold start ready") - start
    finally:
        stop(proc.pid)
        proc.wait()


def held(root: Path) -> tuple[subprocess.Popen, Path, int]:
    control = Path(tempfile.mkdtemp(dir=root))
    port = free_port()
    proc = mocker(root, port, control)
    wait_for(lambda: (control / "ready-for-checkpoint").exists(), 120, "ready-for-checkpoint")
    return proc, control, port


def marker(root: Path) -> float:
    proc, control, port = held(root)
    try:
        start = time.perf_counter()
        (control / "restore-complete").touch()
        return wait_for(lambda: healthy(port), 60, "marker restore ready") - start
    finally:
        stop(proc.pid)
        proc.wait()


def criu_check(criu: str) -> str | None:
    out = subprocess.run([criu, "check"], capture_output=True, text=True)
    return None if out.returncode == 0 else (out.stdout + out.stderr).strip()


def criu_round(root: Path, criu: str) -> tuple[float, float, int]:
    """(dump seconds, restore-to-ready seconds, image bytes)."""
    proc, control, port = held(root)
    images = Path(tempfile.mkdtemp(dir=root))
    start = time.perf_counter()
    dump = subprocess.run([criu, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log", "-v4"],
                          capture_output=True, text=True)
    dump_s = time.perf_counter() - start
    if dump.returncode != 0:
        stop(proc.pid)
        raise RuntimeError(f"criu dump failed:\n{dump.stderr}\n{_tail(images / 'dump.log')}")
    proc.wait(30)  # criu dump ends the process
    (control / "ready-for-checkpoint").unlink(missing_ok=True)  # the dumped image wrote it already
    start = time.perf_counter()
    restore = subprocess.run([criu, "restore", "-D", str(images), "-d", "-o", "restore.log", "-v4",
                              "--pidfile", str(images / "pid")], capture_output=True, text=True)
    if restore.returncode != 0:
        raise RuntimeError(f"criu restore failed:\n{restore.stderr}\n{_tail(images / 'restore.log')}")
    pid = int((images / "pid").read_text())
    image_bytes = sum(f.stat().st_size for f in images.iterdir() if f.suffix == ".img")
    try:
        (control / "restore-complete").touch()
        ready = wait_for(lambda: healthy(port), 60, "criu restore ready") - start
    finally:
        stop(pid)
    return dump_s, ready, image_bytes


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--criu", default=shutil.which("criu") or "criu")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="turbine-ckpt-"))
    problem = criu_check(args.criu)
    if problem:
        print(f"criu ({args.criu}) check failed; criu rounds skipped:\n{problem}\n")
    results: dict[str, list[float]] = {"cold": [], "marker": [], "criu_dump": [], "criu": [], "criu_image_mb": []}
    for r in range(args.repeats):
        order = ["cold", "marker", "criu"]
        if r % 2:
            order.reverse()
        for kind in order:
            if kind == "cold":
                results["cold"].append(cold(root))
            elif kind == "marker":
                results["marker"].append(marker(root))
            elif not problem:
                dump_s, ready_s, image_bytes = criu_round(root, args.criu)
                results["criu_dump"].append(dump_s)
                results["criu"].append(ready_s)
                results["criu_image_mb"].append(image_bytes / 1e6)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items() if v), flush=True)
    medians = {k: statistics.median(v) for k, v in results.items() if v}
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    for kind in ("marker", "criu"):
        if kind in medians:
            print(f"{kind} restore-to-ready / cold start: {medians[kind] / medians['cold']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "medians": medians, "criu_check": problem}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Checkpoint / restore of a worker: cold start vs restore to ready, for the simulated worker (issue #15 §4,
`--worker mocker`) or the real vLLM CPU worker (issue #34, `--worker vllm`: SmolLM2, the test suite's
engine flags, VLLM_CPU_KVCACHE_SPACE=1; run it under the engine lock: flock /tmp/turbine-engine.lock).

Three ways to get a ready worker (GET /health = 200), each timed from its trigger:
- cold: start `python -m turbine.mocker` (or `turbine.vllm`) normally (import, build, sockets, register, canary);
- marker: a checkpoint-mode worker held at ready-for-checkpoint is told restore-complete (the
  warm half alone: wake, sockets, register, canary; no process image involved);
- criu: a checkpoint-mode worker at ready-for-checkpoint is dumped with `criu dump` (which ends
  it), then `criu restore -d` brings it back and restore-complete is written: timed from the
  restore command to /health 200. Only where `criu check` passes; otherwise its error is printed.

    .venv/bin/python -m benchmarks.lifecycle.checkpoint_restore --repeats 3 [--worker vllm] [--criu /path/to/criu]

Without --criu the CRIU that scripts/build_criu.sh builds once is used (Debian bookworm's 3.17.1 cannot
start on kernels >= 6.13). The dump and restore take the flags a vLLM worker needs (tests/integration/criu.py).

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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tests.integration import criu as criu_tools
from turbine.runtime.ports import free_port  # below the ephemeral range: no bind race

from benchmarks.lib.paths import REPO_ROOT

VLLM_FLAGS = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16"]  # as the tests' workers
WORKER = "mocker"  # set by --worker
READY_TIMEOUT_S = 120.0  # one worker's start to /health 200 (--worker vllm: 600)


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


def worker(root: Path, port: int, control: Path | None) -> subprocess.Popen:
    env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", TURBINE_DISCOVERY_DIR=str(root / "discovery"),
               PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    if control is not None:
        env["TURBINE_SNAPSHOT_CONTROL_DIR"] = str(control)
    log = open(root / f"{WORKER}-{port}.log", "wb")
    flags = ["--speedup-ratio", "0"] if WORKER == "mocker" else VLLM_FLAGS
    # Its own session, stdin from /dev/null: a process tree CRIU can dump without --shell-job.
    return subprocess.Popen([sys.executable, "-m", f"turbine.{WORKER}", "--system-port", str(port), *flags],
                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=REPO_ROOT)


def stop(pid: int) -> None:
    """SIGTERM, then SIGKILL after 30 s; its children (a vLLM engine core) are waited for too."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
        procs[0].terminate()
    except psutil.NoSuchProcess:
        return
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)


def cold(root: Path) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = worker(root, port, None)
    try:
        return wait_for(lambda: healthy(port), READY_TIMEOUT_S, "cold start ready") - start
    finally:
        stop(proc.pid)
        proc.wait()


def held(root: Path) -> tuple[subprocess.Popen, Path, int]:
    control = Path(tempfile.mkdtemp(dir=root))
    port = free_port()
    proc = worker(root, port, control)
    wait_for(lambda: (control / "ready-for-checkpoint").exists(), READY_TIMEOUT_S, "ready-for-checkpoint")
    return proc, control, port


def marker(root: Path) -> float:
    proc, control, port = held(root)
    try:
        start = time.perf_counter()
        (control / "restore-complete").touch()
        return wait_for(lambda: healthy(port), 120, "marker restore ready") - start
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
    dump = criu_tools.dump(criu, proc.pid, images)
    dump_s = time.perf_counter() - start
    if dump.returncode != 0:
        stop(proc.pid)
        raise RuntimeError(f"criu dump failed:\n{dump.stderr}\n{_tail(images / 'dump.log')}")
    proc.wait(30)  # criu dump ends the process; reaped, so that the restore can take its pid back
    criu_tools.wait_gone([proc.pid])
    (control / "ready-for-checkpoint").unlink(missing_ok=True)  # the dumped image wrote it already
    start = time.perf_counter()
    pid = criu_tools.restore(criu, images)
    image_bytes = sum(f.stat().st_size for f in images.iterdir() if f.suffix == ".img")
    try:
        (control / "restore-complete").touch()
        ready = wait_for(lambda: healthy(port), 120, "criu restore ready") - start
    finally:
        stop(pid)
        shutil.rmtree(images, ignore_errors=True)  # (a vLLM image is GBs)
    return dump_s, ready, image_bytes


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", choices=["mocker", "vllm"], default="mocker")
    ap.add_argument("--criu", default=None, help="a CRIU >= 4.1 (default: scripts/build_criu.sh's, built once)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    global WORKER, READY_TIMEOUT_S
    WORKER = args.worker
    READY_TIMEOUT_S = 600.0 if WORKER == "vllm" else 120.0
    if args.criu is None:
        args.criu = criu_tools.build()
    shm_before = set(os.listdir("/dev/shm"))
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
        Path(args.out).write_text(json.dumps({"worker": WORKER, "runs": results, "medians": medians,
                                              "criu_check": problem}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    for name in set(os.listdir("/dev/shm")) - shm_before:  # the dumps' link-remap files
        if name.startswith("link_remap."):
            os.unlink(f"/dev/shm/{name}")


if __name__ == "__main__":
    main()

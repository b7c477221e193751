#!/usr/bin/env python3
r"""Sleep / wake of a Turbine vLLM worker through its own endpoints, on a GPU (issue #20, section 4).

The whole worker runs (`python -m turbine.vllm --enable-sleep-mode`, discovery, request plane,
status server) behind a frontend; the script only speaks HTTP: `POST /engine/sleep {"level": L}`
and `POST /engine/wake_up` on the worker's status port, chats through the frontend. For each level,
`--cycles` times: sleep -> GPU memory (NVML: device-wide and the engine's processes) -> what the
frontend answers meanwhile -> wake -> time until the frontend routes to the worker again -> the
same greedy chats, compared with the answers from before the first sleep (the first answer after
waking is the one the issue asks about; all are compared). Level 2 needs weights on disk to load
again (the worker refuses level 2 on dummy weights), so the model is a real checkpoint (the
embedded SmolLM2, converted on the host).

With `--checkpoint` (issue #34 §1 on a GPU), a second worker then starts in checkpoint mode
(TURBINE_SNAPSHOT_CONTROL_DIR, turbine/worker/snapshot.py) and is driven by its markers as a
snapshot agent would, without a dump (no CRIU for CUDA processes here): its engine is built and
quiesced by a level-1 sleep before any socket of Turbine's opens -> `ready-for-checkpoint` -> GPU
memory read while quiesced, nothing registered -> `restore-context.json` (a new instance id) and
`restore-complete`, as a restored copy would see them -> the time until the frontend routes to it,
the instance id it registered under, and the same greedy chats compared with the plain worker's.

    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_sleep_worker --model <folder> [--checkpoint] --out $OUT/gpu_sleep_worker.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.gpu.gpu_serving import Procs, free_port, log, machine
from benchmarks.gpu.sleep_wake_gpu import GpuMemory
from benchmarks.lib.proc import exit_on_sigterm


SERVED = "model"
CHATS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea.",
         "List three prime numbers greater than 50."]


def http(method: str, url: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def answers(base: str, max_tokens: int) -> list[str]:
    out = []
    for p in CHATS:
        status, r = http("POST", f"{base}/v1/chat/completions",
                         {"model": SERVED, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                          "temperature": 0.0})
        out.append(r["choices"][0]["message"]["content"] if status == 200 else f"HTTP {status}: {r}")
    return out


def routable(base: str) -> bool:
    status, body = http("GET", f"{base}/health", timeout=5)
    return status == 200 and isinstance(body, dict) and (body.get("models") or {}).get(SERVED) == 1


def registered_ids(discovery_dir: str) -> list[str]:
    """The instance ids of the generate endpoints in file discovery."""
    import asyncio

    from turbine.runtime.discovery.file import FileDiscovery
    from turbine.runtime.discovery.registry import Registry

    async def go():
        return [r.instance_id for r in await Registry(FileDiscovery(discovery_dir)).list_instances()
                if r.endpoint == "generate"]
    return asyncio.run(go())


def checkpoint_phase(a, procs: Procs, gpu, env: dict, worker_argv: list[str], base: str, reference: list[str],
                     run_dir: Path) -> dict:
    """A worker in checkpoint mode, quiesced (level-1 sleep) and then answered `restore-complete`."""
    from turbine.worker.snapshot import READY_FOR_CHECKPOINT, RESTORE_COMPLETE, RESTORE_CONTEXT, SNAPSHOT_CONTROL_DIR_ENV

    control = Path(tempfile.mkdtemp(prefix="control_", dir=run_dir))
    rec: dict = {"memory_before": gpu.read()}
    t = time.perf_counter()
    procs.spawn("checkpointed", worker_argv, dict(env, **{SNAPSHOT_CONTROL_DIR_ENV: str(control)}))
    procs.wait(lambda: (control / READY_FOR_CHECKPOINT).exists(), a.start_timeout, "ready-for-checkpoint")
    rec["ready_for_checkpoint_s"] = round(time.perf_counter() - t, 1)
    time.sleep(1.0)
    rec["memory_quiesced"] = gpu.read()
    rec["registered_while_quiesced"] = registered_ids(env["TURBINE_DISCOVERY_DIR"])
    (control / RESTORE_CONTEXT).write_text(json.dumps({"version": 1, "env": {"TURBINE_INSTANCE_ID": "restored-1"}}))
    t = time.perf_counter()
    (control / RESTORE_COMPLETE).touch()
    rec["routable_after_restore_s"] = round(procs.wait(lambda: routable(base), 120, "the restored worker"), 2)
    rec["registered_after_restore"] = registered_ids(env["TURBINE_DISCOVERY_DIR"])
    rec["memory_restored"] = gpu.read()
    after = answers(base, a.max_tokens)
    rec["answers_equal"] = f"{sum(x == y for x, y in zip(after, reference))}/{len(reference)}"
    if after != reference:
        rec["answers"] = after
    rec["ok"] = (not rec["registered_while_quiesced"] and rec["registered_after_restore"] == ["restored-1"]
                 and after == reference)
    log(f"checkpoint mode: ready-for-checkpoint after {rec['ready_for_checkpoint_s']}s, quiesced "
        f"{rec['memory_quiesced']['used_gib']} GiB (awake worker before: {rec['memory_before']['used_gib']} GiB), "
        f"registered while quiesced {rec['registered_while_quiesced']}, routable {rec['routable_after_restore_s']}s "
        f"after restore-complete as {rec['registered_after_restore']}, answers equal {rec['answers_equal']}: "
        f"{'PASS' if rec['ok'] else 'FAIL'}")
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--engine-args", default="", help="more worker flags, space separated")
    p.add_argument("--start-timeout", type=float, default=400)
    p.add_argument("--checkpoint", action="store_true",
                   help="then a worker in checkpoint mode: quiesce (level-1 sleep) and restore-complete (issue #34)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_sleep_worker.json")
    a = p.parse_args(argv)
    exit_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_sleep_worker_"))
    gpu = GpuMemory()  # GPU 0 (NVML's index 0: run with CUDA_VISIBLE_DEVICES unset or 0)
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "gpu": gpu.name, "driver": gpu.driver, "args": {k: str(v) for k, v in vars(a).items()},
           "memory": {"before_worker": gpu.read()}, "cycles": []}
    procs = Procs(run_dir)
    env = {"TURBINE_DISCOVERY_BACKEND": "file", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0",
           "TURBINE_DISCOVERY_DIR": tempfile.mkdtemp(prefix="discovery_", dir=run_dir)}
    status_port, http_port = free_port(), free_port()
    worker = [sys.executable, "-m", "turbine.vllm", "--model", str(a.model), "--served-model-name", SERVED,
              "--enable-sleep-mode", "--system-port", str(status_port), *a.engine_args.split()]
    if a.dtype:
        worker += ["--dtype", a.dtype]
    ws, base = f"http://127.0.0.1:{status_port}", f"http://127.0.0.1:{http_port}"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        procs.spawn("worker", worker, env)
        procs.spawn("frontend", [sys.executable, "-m", "turbine.frontend", "--http-port", str(http_port)], env)
        try:
            doc["start_s"] = round(procs.wait(lambda: routable(base), a.start_timeout, "worker"), 1)
        except Exception:
            log(procs.tail("worker"))
            raise
        doc["memory"]["awake_after_start"] = gpu.read()
        reference = answers(base, a.max_tokens)
        doc["reference"] = reference
        log(f"ready after {doc['start_s']}s; reference answers: {[r[:40] for r in reference]}")
        for level in (1, 2):
            for cycle in range(a.cycles):
                rec: dict = {"level": level, "cycle": cycle}
                t = time.perf_counter()
                rec["sleep_status"], rec["sleep_reply"] = http("POST", f"{ws}/engine/sleep", {"level": level})
                rec["sleep_s"] = round(time.perf_counter() - t, 3)
                rec["is_sleeping"] = http("GET", f"{ws}/engine/is_sleeping")[1]
                time.sleep(1.0)  # let the allocator settle before reading
                rec["memory_asleep"] = gpu.read()
                rec["frontend_health_asleep"] = http("GET", f"{base}/health", timeout=5)[1]
                st, body = http("POST", f"{base}/v1/chat/completions",
                                {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                rec["chat_while_asleep"] = {"status": st, "body": body if st != 200 else "answered"}
                t = time.perf_counter()
                rec["wake_status"], rec["wake_reply"] = http("POST", f"{ws}/engine/wake_up")
                rec["wake_s"] = round(time.perf_counter() - t, 3)
                deadline = time.monotonic() + 60
                while not routable(base) and time.monotonic() < deadline:
                    time.sleep(0.05)
                rec["routable_after_wake_s"] = round(time.perf_counter() - t, 3)
                rec["memory_awake"] = gpu.read()
                t = time.perf_counter()
                after = answers(base, a.max_tokens)
                rec["answers_s"] = round(time.perf_counter() - t, 3)
                rec["first_answer_equal"] = after[0] == reference[0]
                rec["answers_equal"] = f"{sum(x == y for x, y in zip(after, reference))}/{len(reference)}"
                if after != reference:
                    rec["answers"] = after
                doc["cycles"].append(rec)
                log(f"level {level} cycle {cycle}: sleep {rec['sleep_status']} {rec['sleep_s']}s, asleep "
                    f"{rec['memory_asleep']['used_gib']} GiB, wake {rec['wake_status']} {rec['wake_s']}s, routable "
                    f"{rec['routable_after_wake_s']}s, awake {rec['memory_awake']['used_gib']} GiB, answers equal "
                    f"{rec['answers_equal']}, while asleep HTTP {st}")
        if a.checkpoint:
            procs.stop("worker")
            procs.wait(lambda: not routable(base), 60, "the plain worker gone")
            doc["checkpoint"] = checkpoint_phase(a, procs, gpu, env, worker, base, reference, run_dir)
    finally:
        procs.stop()
        a.out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {a.out} (logs in {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
r"""One worker SIGKILLed mid-stream, Turbine beside NVIDIA Dynamo (issue #15, "Must hold").

The recipe of the peer's `chaos_kill_one.sh` (../shared/peer/), with free ports and paths from flags so
that it can run anywhere and beside other work: for each system and migration limit, start a frontend
and two simulated workers (speedup 1, each its own process), open 8 concurrent streaming completions
(`ignore_eos`, `max_tokens` fixed), SIGKILL the process group of the first worker once every stream has
streamed a quarter of its tokens (`--kill-at-fraction`), and count the streams that end with all their
tokens (usage) and no error.  Systems and limits alternate, and the order reverses on odd repeats.

  turbine  python -m turbine.frontend --http-port P [--migration-limit N]
           python -m turbine.mocker --model MODEL --served-model-name smol      (x2, file discovery)
  dynamo   zmq_broker.py + python -m dynamo.frontend --http-port P --migration-limit N
           python -m dynamo.mocker --model-path MODEL --model-name smol        (x2, file discovery)

The Dynamo side needs its own venv (`make bench-peer`, found in .peer-venv; or `--dynamo-python` / env
DYNAMO_PYTHON) and the peer recipe's zmq_broker.py (`--zmq-broker`, env BROKER; default shared/peer in
or beside the checkout).
Dynamo's mocker decodes ~5x faster than Turbine's (its default timing is a GPU's; Turbine's is the
2-core CPU worker's), so each system gets its own `max_tokens` (defaults 1500 and 200, as the peer's
recipe) and both are killed at the same fraction of their streams.

  .venv/bin/python -m benchmarks.lifecycle.kill_one_side_by_side --systems turbine,dynamo --limits 3,0 --repeats 3 \
      --out benchmarks/results/lifecycle/kill_one-$(date +%F).json

`--limits off` runs Turbine's frontend without the flag (main before request migration).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.load import sse_chunks
from benchmarks.lib.paths import default_dynamo_python, default_model, shared_path
from benchmarks.lib.proc import exit_on_sigterm, http_get_json, log, Proc, tail
from benchmarks.lib.stack import turbine_origin
from turbine.runtime.ports import free_port


MODEL_NAME = "smol"
PROMPT = "tell me a story " * 20


class System:
    """One stack: a frontend and two worker processes, the first of which is the victim."""

    def __init__(self, name: str, limit: str, a: argparse.Namespace, run_dir: Path):
        self.name, self.limit, self.a, self.run_dir = name, limit, a, run_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.workers: list[Proc] = []

    def spawn(self, what: str, argv: list[str], env: dict[str, str]) -> Proc:
        p = Proc(f"{self.name}-{self.limit} {what}", argv, env, self.run_dir / f"{what}.log")
        self.procs.append(p)
        return p

    def start(self, model: str) -> None:
        if self.name == "turbine":
            env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", PYTHONUNBUFFERED="1",
                       TURBINE_DISCOVERY_DIR=str(self.run_dir / "discovery"))
            py = self.a.turbine_python
            mig = [] if self.limit == "off" else ["--migration-limit", self.limit]
            self.spawn("frontend", [py, "-m", "turbine.frontend", "--http-port", str(self.port), *mig], env)
            for i in (1, 2):
                self.workers.append(self.spawn(f"worker{i}", [py, "-m", "turbine.mocker", "--model", model,
                                                              "--served-model-name", MODEL_NAME], env))
            return
        xsub, xpub = free_port(), free_port()
        home = self.run_dir / "home"
        home.mkdir()
        env = dict(os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(self.run_dir / "dynkv"),
                   DYN_REQUEST_PLANE="tcp", DYN_EVENT_PLANE="zmq", DYN_TCP_RPC_HOST="127.0.0.1",
                   DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1",
                   DYN_SYSTEM_HOST="127.0.0.1", DYN_ZMQ_BROKER_URL=f"xsub=tcp://127.0.0.1:{xsub},xpub=tcp://127.0.0.1:{xpub}",
                   HOME=str(home), DYN_SELF_HOST_METADATA="0", HF_HUB_OFFLINE="1")
        py = self.a.dynamo_python
        mig = "0" if self.limit == "off" else self.limit
        self.spawn("broker", [py, self.a.zmq_broker, str(xsub), str(xpub)], env)
        self.spawn("frontend", [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                str(self.port), "--migration-limit", mig], env)
        for i in (1, 2):
            self.workers.append(self.spawn(f"worker{i}", [py, "-m", "dynamo.mocker", "--model-path", model,
                                                          "--model-name", MODEL_NAME], env))
            time.sleep(3)  # as the peer's recipe: its file discovery is happier with staggered starts

    def instances(self) -> int:
        status, body = http_get_json(f"{self.url}/health")
        if status != 200 or not isinstance(body, dict):
            return 0
        if self.name == "turbine":
            return int((body.get("models") or {}).get(MODEL_NAME, 0))
        return sum(1 for i in body.get("instances") or [] if i.get("endpoint") == "generate")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{tail(p.log_path)}")
            try:
                if self.instances() == 2:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: 2 workers not visible after {timeout:.0f}s; logs in {self.run_dir}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(10)


async def one_stream(client, url: str, max_tokens: int, progress: list[int], i: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    rec = {"completion_tokens": 0, "error": None, "finish_reason": None, "ids": set()}
    try:
        async for chunk in sse_chunks(client, f"{url}/v1/completions", body):
            rec["ids"].add(chunk.get("id"))
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    progress[i] += 1  # chunks with text: a lower bound on tokens streamed
                if choice.get("finish_reason"):
                    rec["finish_reason"] = choice["finish_reason"]
            if chunk.get("usage"):
                rec["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # the benchmark's point: record how a stream broke, whatever broke it
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return rec


async def drive(system: System, a: argparse.Namespace) -> dict:
    import httpx

    max_tokens = a.turbine_max_tokens if system.name == "turbine" else a.dynamo_max_tokens
    progress = [0] * a.streams
    kill_after = max(1, int(max_tokens * a.kill_at_fraction))
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one_stream(client, system.url, max_tokens, progress, i)) for i in range(a.streams)]
        while min(progress) < kill_after and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        killed_at = time.monotonic() - t0
        at_kill = list(progress)
        os.killpg(system.workers[0].popen.pid, signal.SIGKILL)
        recs = await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    for r in recs:
        r["ids"] = sorted(x for x in r["ids"] if x)
    complete = [r["error"] is None and r["completion_tokens"] == max_tokens and r["finish_reason"] == "length"
                and len(r["ids"]) == 1 for r in recs]
    return {"max_tokens": max_tokens, "killed_at_s": round(killed_at, 2), "chunks_at_kill": at_kill,
            "wall_s": round(wall, 2), "streams": a.streams, "completed": sum(complete),
            "failed": [r for r, ok in zip(recs, complete) if not ok]}


def run_one(a: argparse.Namespace, name: str, limit: str, rep: int, out_dir: Path, model: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-{limit}-r{rep}-", dir=out_dir))
    system = System(name, limit, a, run_dir)
    try:
        system.start(model)
        system.wait_ready(a.startup_timeout)
        time.sleep(a.settle_s)
        result = asyncio.run(drive(system, a))
    finally:
        system.stop()
    result.update(system=name, migration_limit=limit, repeat=rep, logs=str(run_dir))
    log(f"{name} limit {limit} rep {rep}: {result['completed']}/{result['streams']} complete "
        f"(killed at {result['killed_at_s']}s, chunks at kill {result['chunks_at_kill']}); "
        + "; ".join(sorted({str(f['error'])[:90] for f in result['failed']})))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="turbine,dynamo", help="comma list of turbine, dynamo")
    p.add_argument("--limits", default="3,0", help="comma list of migration limits; 'off' = no flag (Turbine)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--turbine-max-tokens", type=int, default=200)
    p.add_argument("--dynamo-max-tokens", type=int, default=1500)
    p.add_argument("--kill-at-fraction", type=float, default=0.25,
                   help="SIGKILL the first worker once every stream has this fraction of its tokens")
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`'s)")
    p.add_argument("--turbine-python", default=sys.executable)
    p.add_argument("--dynamo-python", default=os.environ.get("DYNAMO_PY") or default_dynamo_python(),
                   help="the peer venv's python (env DYNAMO_PYTHON; default: make bench-peer's .peer-venv/bin/python)")
    p.add_argument("--zmq-broker", default=os.environ.get("BROKER", str(shared_path("peer", "zmq_broker.py"))),
                   help="the peer recipe's zmq_broker.py (env BROKER; default shared/peer/ in or beside the checkout)")
    p.add_argument("--startup-timeout", type=float, default=120)
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after both workers are visible")
    p.add_argument("--work-dir", default=None, help="logs of every run (default: a temp folder)")
    p.add_argument("--out", default=None, help="JSON results file")
    a = p.parse_args(argv)
    exit_on_sigterm()
    systems = [s for s in a.systems.split(",") if s]
    limits = [x for x in a.limits.split(",") if x]
    for s in systems:
        if s not in ("turbine", "dynamo"):
            p.error(f"--systems: unknown system {s!r}")
    if "dynamo" in systems and not (a.dynamo_python and a.zmq_broker):
        p.error("--dynamo-python and --zmq-broker (or env DYNAMO_PYTHON, BROKER; or make bench-peer) are needed "
                "for dynamo")
    for x in limits:
        if x != "off" and not x.isdigit():
            p.error(f"--limits: {x!r} is neither a number nor 'off'")
    model = a.model or default_model(a.turbine_python)
    out_dir = Path(a.work_dir or tempfile.mkdtemp(prefix="kill_one_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    plan = [(s, lim) for lim in limits for s in systems if not (s == "dynamo" and lim == "off")]
    runs = []
    for rep in range(a.repeats):
        for name, limit in (plan if rep % 2 == 0 else plan[::-1]):
            runs.append(run_one(a, name, limit, rep, out_dir, model))
    summary = {}
    for name, limit in plan:
        done = [r["completed"] for r in runs if r["system"] == name and r["migration_limit"] == limit]
        summary[f"{name} limit {limit}"] = {"completed_per_repeat": done, "streams": a.streams}
    print(json.dumps(summary, indent=1))
    if a.out:
        doc = {"benchmark": "kill_one_side_by_side", "started_utc": started, "argv": sys.argv, "args": vars(a),
               "model": model, "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
               "turbine": turbine_origin(a.turbine_python), "summary": summary, "runs": runs}
        Path(a.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

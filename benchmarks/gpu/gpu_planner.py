#!/usr/bin/env python3
r"""The SLA planner's disaggregated mode against real GPU workers under a short ramp (issue #30 §3): no
request lost while it scales the decode role.

A Turbine frontend (file discovery, `--migration-limit`, `--max-local-prefill-length 0`: every prompt is
prefilled remotely, so KV moves on every request) and the planner process (`python -m turbine.planner
--mode disagg --connector local`), which starts every worker itself: one prefill worker (min = max = 1) and
one to `--max-decode` decode workers. The local connector gives every worker of a role the same environment
(`roles.ROLE.env`), so it cannot hand each started worker a GPU of its own: each ROLE is pinned to one GPU
(`--prefill-gpu`, `--decode-gpu`, CUDA_VISIBLE_DEVICES), and the second decode worker shares the decode GPU
with the first (`--gpu-memory-utilization` leaves room for both). With `--sleep-pool 1` (default) a step down
puts a decode worker to sleep (`/engine/sleep`, level `--sleep-level`) and the next step up wakes it; with 0 it
is stopped and the next step up starts a cold one.

The load: streamed `/v1/completions` through the official `openai` client (no retries: a retry would hide a
failure), token-id prompts of `--isl` tokens, `--osl` tokens with ignore_eos, Poisson arrivals whose rate
follows `--phases` (default low → high → low → high → low: the first peak makes the planner add a decode
worker cold, the dip takes it out (asleep with the pool), the second peak brings it back (a wake)). Every
request is counted: whole (finish_reason `length`, all `--osl` tokens, one response id) or lost (an error, a
short or broken stream, or unfinished `--tail-timeout` s after the last arrival).

The planner sizes from an engine profile. Unless `--profile` gives a measured one (`turbine profile`), it is a
synthetic one written here: one decode engine sustains `--decode-capacity` requests/s at the ITL target
(default 0.625 × the high rate, so the high rate needs two decode workers and the low rate one) and a prefill
takes 5 % of the TTFT target. The point is the scaling under traffic, not the planner's accuracy: on the GPU
the real engines are far faster than this profile says.

Recorded (--out JSON, with the machine and the commit): every request's outcome, per phase; the planner's
decisions (its log and `turbine_planner_decisions_total`) and the connector's actions (started, registered,
asleep, woken, exited); replicas per role over time (the planner's ready / starting / asleep / target and the
frontend's view, every `--sample-s`); per decode worker its requests and, on vLLM, every `vllm:nixl_*` series
and the prompt tokens by source (KV pulled vs computed); the frontend's remote / local prefills and
migrations; GPU memory per card (nvidia-smi) while it runs. Checks printed PASS / FAIL: no request lost, a
decode worker added and serving, the role back down after the peak, KV moved; exit 1 if one fails.

`--engine mocker` runs the whole control flow on a CPU host with Turbine's simulated workers (the same
profile's timing, a `--mocker-startup-s` start-up, sleep and wake; at `--mocker-speedup` above 1 they stay under
target at the high rate, so the throughput path adds the decode worker, as it does on a GPU; at 1 the load path
does, from the overloaded engine's reports):

    .venv/bin/python -m benchmarks.gpu.gpu_planner --engine mocker --low-rps 0.5 --high-rps 3 --isl 256 --osl 64 \
        --phases low:10,high:40,low:30,high:15,low:10 --adjustment-interval 5 --fast-interval 1 --out /tmp/gpu_planner_mocker.json
    STEP_TIMEOUT=540 bash benchmarks/gpu/gpu_tests.sh planner      # two GPUs: the Llama-3.1-8B architecture, dummy weights
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.gpu.gpu_serving import machine
from benchmarks.lib.metrics import scrape
from benchmarks.lib.proc import exit_on_sigterm, http_get_json, log, tail
from benchmarks.lib.results import dump_json, git_commit
from benchmarks.lib.stack import Stack, turbine_env
from benchmarks.lib.stats import pct
from turbine.runtime.ports import free_port

SERVED = "model"
ROLES = ("prefill", "decode")
STEP_BASE_MS = 10.0  # the synthetic profile's fixed cost of a step


# --------------------------------------------------------------------------- arguments
@dataclass(frozen=True)
class Phase:
    name: str
    rps: float
    seconds: float


def parse_phases(text: str, low_rps: float, high_rps: float) -> list[Phase]:
    """"low:20,high:120,2.5:30": each NAME:SECONDS, NAME low, high or a rate in requests/s."""
    phases = []
    for part in text.split(","):
        name, sep, seconds = part.strip().partition(":")
        try:
            rps = {"low": low_rps, "high": high_rps}[name] if name in ("low", "high") else float(name)
            length = float(seconds)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--phases: {part!r}: expected low|high|RPS:SECONDS") from None
        if not sep or length <= 0 or rps < 0:
            raise argparse.ArgumentTypeError(f"--phases: {part!r}: expected low|high|RPS:SECONDS, seconds > 0")
        phases.append(Phase(name, rps, length))
    return phases


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "mocker"), default="vllm",
                   help="the workers: vLLM on the GPUs, or Turbine's mocker (a dry run of the control flow on a CPU)")
    p.add_argument("--model", default=None, help="vllm: the model folder (e.g. /tmp/h8/model-llama-3.1-8b); mocker: "
                                                 "its tokenizer and config (default: the embedded SmolLM2)")
    p.add_argument("--load-format", default=None, help="vllm: --load-format (dummy: random weights)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="vllm: each worker's share of its GPU; the decode GPU holds up to --max-decode of them")
    p.add_argument("--engine-args", default="", help="more flags for every worker, space separated")
    p.add_argument("--frontend-args", default="", help="more frontend flags, space separated")
    p.add_argument("--prefill-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the prefill role")
    p.add_argument("--decode-gpu", default="1", help="CUDA_VISIBLE_DEVICES of the decode role (all its workers)")
    p.add_argument("--max-decode", type=int, default=2, help="most decode workers (at least 1 always runs)")
    p.add_argument("--sleep-pool", type=int, default=1, help="decode workers a step down puts to sleep rather than "
                   "stopping (vllm: --enable-sleep-mode); 0: stopped, and a step up starts a cold one")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=1)
    p.add_argument("--strict-kv", action="store_true", help="vllm: a decode worker's failed KV pull fails the "
                   "request (kv_load_failure_policy fail) instead of Turbine's default recompute")
    p.add_argument("--kv-buffer-device", default="cuda", help="vllm with --strict-kv: where the KV buffer lives")
    p.add_argument("--migration-limit", type=int, default=3)
    # The planner.
    p.add_argument("--profile", default=None, help="a measured engine profile (turbine profile) instead of the "
                                                   "synthetic one")
    p.add_argument("--decode-capacity", type=float, default=None, help="the synthetic profile: requests/s one decode "
                   "engine sustains at the ITL target (default 0.625 x --high-rps)")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--itl-ms", type=float, default=50.0)
    p.add_argument("--adjustment-interval", type=float, default=10.0, help="the throughput path's interval, s")
    p.add_argument("--fast-interval", type=float, default=2.0, help="the load path's interval, s")
    p.add_argument("--predictor", default="constant")
    p.add_argument("--startup-s", type=float, default=None, help="the planner's expected start-up (default: observed)")
    p.add_argument("--wake-s", type=float, default=1.0, help="the planner's expected wake from the pool, s")
    p.add_argument("--drain-timeout", type=float, default=15.0, help="a stopped or slept worker's drain bound, s")
    # The mocker (--engine mocker).
    p.add_argument("--mocker-startup-s", type=float, default=5.0, help="a simulated worker's start-up, s")
    p.add_argument("--mocker-sleep-s", type=float, default=0.4)
    p.add_argument("--mocker-wake-s", type=float, default=0.6)
    p.add_argument("--mocker-speedup", type=float, default=1.0, help="the simulated engine runs this many times "
                   "faster than the profile says (above 1: under target at the high rate, so the throughput path "
                   "decides, as on a GPU)")
    # The load.
    p.add_argument("--low-rps", type=float, default=1.0)
    p.add_argument("--high-rps", type=float, default=8.0)
    p.add_argument("--phases", default="low:20,high:120,low:50,high:30,low:20",
                   help="NAME:SECONDS,... with NAME low, high or a rate (requests/s)")
    p.add_argument("--isl", type=int, default=512, help="prompt tokens (random ids, a fresh prompt each)")
    p.add_argument("--osl", type=int, default=128, help="output tokens (ignore_eos)")
    p.add_argument("--warmup", type=int, default=4, help="requests one at a time before the ramp (not counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tail-timeout", type=float, default=180.0,
                   help="seconds after the last arrival a request may still take; later ones count as lost")
    p.add_argument("--start-timeout", type=float, default=480.0, help="seconds for the first workers to serve")
    p.add_argument("--sample-s", type=float, default=1.0, help="seconds between samples of the replicas")
    p.add_argument("--run-dir", default=None, help="logs and the planner's files (default: a new /tmp folder)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_planner.json")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    a = p.parse_args(argv)
    try:
        a.phase_list = parse_phases(a.phases, a.low_rps, a.high_rps)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.engine == "vllm" and not a.model:
        p.error("--engine vllm needs --model (a folder with config.json and a tokenizer)")
    if a.max_decode < 2:
        p.error("--max-decode must be >= 2: with one decode worker at most there is nothing to scale")
    if a.sleep_pool < 0:
        p.error("--sleep-pool must be >= 0")
    if a.decode_capacity is None:
        a.decode_capacity = 0.625 * a.high_rps
    if a.profile is None and not a.low_rps < a.decode_capacity < a.high_rps:
        p.error(f"the synthetic profile's --decode-capacity {a.decode_capacity:g} must lie between --low-rps "
                f"{a.low_rps:g} (one decode worker) and --high-rps {a.high_rps:g} (two), or nothing scales")
    if a.itl_ms <= STEP_BASE_MS:
        p.error(f"--itl-ms must be above the synthetic profile's step base, {STEP_BASE_MS:g} ms")
    return a


# --------------------------------------------------------------------------- the planner's setup
def synthetic_profile(a) -> dict:
    """An engine profile (turbine-profile/1, timing coefficients only) whose decode engine sustains
    `decode_capacity` requests/s at the ITL target for this ISL / OSL, and whose prefill of the ISL takes 5 % of
    the TTFT target. By Little's law an engine at that rate holds b = rate x OSL x ITL sequences; the step time
    reaches the ITL target at b: step(b) = base + b x per_seq."""
    batch = decode_batch(a)
    seqs = max_seqs(a)
    per_seq = (a.itl_ms - STEP_BASE_MS) / batch
    per_token = max(0.001, (0.05 * a.ttft_ms - STEP_BASE_MS) / a.isl)
    return {"format": "turbine-profile/1",
            "source": f"synthetic (benchmarks/gpu/gpu_planner.py): a decode engine sustains {a.decode_capacity:g} "
                      f"requests/s at ITL {a.itl_ms:g} ms (ISL {a.isl}, OSL {a.osl}); a prefill takes 5 % of the TTFT "
                      f"target",
            "engine": {"max_num_seqs": seqs, "max_num_batched_tokens": max(2048, a.isl),
                       "kv_tokens": 2 * seqs * (a.isl + a.osl), "context_length": a.max_model_len},
            "timing": {"step_base_ms": STEP_BASE_MS, "prefill_ms_per_token": per_token,
                       "prefill_ms_per_token_pair": 0.0, "decode_ms_per_seq": per_seq, "decode_ms_per_kv_token": 0.0}}


def decode_batch(a) -> float:
    """The sequences a decode engine at `decode_capacity` requests/s holds at the ITL target (Little's law)."""
    return a.decode_capacity * a.osl * a.itl_ms / 1000.0


def max_seqs(a) -> int:
    """The synthetic engine's batch limit: twice what it holds at the target (an overloaded one queues beyond)."""
    return max(64, math.ceil(2 * decode_batch(a)))


def role_args(a, role: str, profile_path: str) -> list[str]:
    """One worker's flags (the connector adds its role, status port, drain bound and discovery)."""
    common = ["--served-model-name", SERVED, "--max-model-len", str(a.max_model_len)]
    if a.model:
        common = ["--model", str(a.model), *common]
    if a.engine == "mocker":  # the simulated engine runs the planner's profile (its timing coefficients)
        seqs = max_seqs(a)
        blocks = math.ceil(2 * seqs * (a.isl + a.osl) / 16)
        return [*common, "--profile", profile_path, "--speedup-ratio", f"{a.mocker_speedup:g}", "--block-size", "16",
                "--num-gpu-blocks", str(blocks), "--max-num-seqs", str(seqs), "--startup-time", f"{a.mocker_startup_s:g}",
                "--sleep-time", f"{a.mocker_sleep_s:g}", "--wake-time", f"{a.mocker_wake_s:g}", *a.engine_args.split()]
    out = [*common, "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if a.load_format:
        out += ["--load-format", a.load_format]
    if role == "decode" and a.sleep_pool > 0:
        out.append("--enable-sleep-mode")
    if role == "decode" and a.strict_kv:  # as gpu_disagg.py: a failed pull fails the request, visibly
        from turbine.vllm.connectors import kv_transfer_config

        cfg = kv_transfer_config(["nixl"], buffer_device=a.kv_buffer_device, decode=True)
        cfg["kv_load_failure_policy"] = "fail"
        out += ["--kv-transfer-config", json.dumps(cfg)]
    else:
        out += ["--connector", "nixl"]
    return [*out, *a.engine_args.split()]


def planner_config(a, run_dir: Path, profile_path: str, frontend_url: str, status_port: int) -> dict:
    """The planner's --config: disaggregated, the local connector, prefill 1..1 on one GPU and decode
    1..max_decode on the other (a role's env pins every worker of it)."""
    gpus = {"prefill": a.prefill_gpu, "decode": a.decode_gpu}
    roles = {role: {"engine": a.engine, "args": role_args(a, role, profile_path),
                    "env": {"CUDA_VISIBLE_DEVICES": str(gpus[role])}} for role in ROLES}
    cfg = {"profile": profile_path, "mode": "disagg", "model": SERVED, "ttft_ms": a.ttft_ms, "itl_ms": a.itl_ms,
           "adjustment_interval_s": a.adjustment_interval, "fast_interval_s": a.fast_interval,
           "predictor": a.predictor, "wake_s": a.wake_s,
           "min_replicas": {"prefill": 1, "decode": 1}, "max_replicas": {"prefill": 1, "decode": a.max_decode},
           "max_workers": 1 + a.max_decode, "connector": "local",
           "connector_options": {"roles": roles, "log_dir": str(run_dir / "workers"),
                                 "drain_timeout": a.drain_timeout, "sleep_pool": a.sleep_pool,
                                 "sleep_level": a.sleep_level},
           "frontend_url": frontend_url, "system_port": status_port}
    if a.startup_s is not None:
        cfg["startup_s"] = a.startup_s
    return cfg


# --------------------------------------------------------------------------- load
def arrivals(a) -> list[tuple[float, int]]:
    """(seconds from the ramp's start, phase index) of every request: a Poisson process per phase."""
    rng = random.Random(a.seed)
    out, start = [], 0.0
    for k, ph in enumerate(a.phase_list):
        t = start
        while ph.rps > 0:
            t += rng.expovariate(ph.rps)
            if t >= start + ph.seconds:
                break
            out.append((t, k))
        start += ph.seconds
    return out


def prompt_ids(seed: int, i: int, isl: int) -> list[int]:
    """A fresh prompt per request (no prefix cache hit: every prompt's KV is computed and moved), from ids
    every tokenizer here has (SmolLM2's base vocabulary, which the 8B folder's tokenizer extends)."""
    rng = random.Random(seed * 1_000_003 + i)
    return [rng.randrange(100, 49000) for _ in range(isl)]


class Load:
    """The ramp's requests through one openai client; `inflight` is read by the sampler."""

    def __init__(self, a, base_url: str):
        self.a, self.base_url = a, base_url
        self.inflight = 0
        self.phase = "start"
        self.done: list[dict] = []  # the ramp's finished requests so far (what is left if the run is cut short)

    async def one(self, client, i: int, phase: int, at: float, t0: float) -> dict:
        rec = {"i": i, "phase": phase, "at": round(at, 3), "ttft": None, "tokens": 0, "completion_tokens": None,
               "finish_reason": None, "ids": [], "error": None}
        sent = time.monotonic()
        self.inflight += 1
        try:
            stream = await client.completions.create(
                model=SERVED, prompt=prompt_ids(self.a.seed, i, self.a.isl), max_tokens=self.a.osl, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.id and chunk.id not in rec["ids"]:
                    rec["ids"].append(chunk.id)
                for choice in chunk.choices or ():
                    if choice.text:
                        rec["tokens"] += 1
                        if rec["ttft"] is None:
                            rec["ttft"] = time.monotonic() - sent
                    if choice.finish_reason:
                        rec["finish_reason"] = choice.finish_reason
                if chunk.usage:
                    rec["completion_tokens"] = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 (any failure is a result: counted)
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.inflight -= 1
        rec["t_end"] = round(time.monotonic() - t0, 3)
        rec["seconds"] = round(time.monotonic() - sent, 3)
        if rec["error"] is None and not whole(rec, self.a.osl):
            rec["error"] = (f"incomplete: finish_reason {rec['finish_reason']}, {rec['completion_tokens']} tokens of "
                            f"{self.a.osl}, {len(rec['ids'])} response ids")
        if phase >= 0:
            self.done.append(rec)
        return rec

    async def follow_phases(self, t0: float) -> None:
        """Names the phase under way (the sampler's rows carry it) until the ramp's end."""
        start = 0.0
        for k, ph in enumerate(self.a.phase_list):
            await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
            self.phase = f"{ph.name}#{k}"
            log(f"phase {k} ({ph.name}): {ph.rps:g} requests/s for {ph.seconds:g}s")
            start += ph.seconds
        await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))

    async def run(self, plan: list[tuple[float, int]]) -> tuple[list[dict], int]:
        """Every planned request sent at its time; returns the records and how many were still running
        `tail_timeout` s after the last arrival (cancelled: lost)."""
        import httpx
        from openai import AsyncOpenAI

        # max_retries=0: the client's own retries would turn a failed request into a late success.
        client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                             timeout=httpx.Timeout(600.0, connect=30.0))
        for i in range(self.a.warmup):  # the first NIXL handshake and engine warm-up, outside the count
            self.phase = "warmup"
            rec = await self.one(client, -1 - i, -1, 0.0, time.monotonic())
            log(f"warm-up request {i + 1}/{self.a.warmup}: {rec['error'] or 'ok'} in {rec['seconds']:.1f}s")
        tasks: list[asyncio.Task] = []
        t0 = time.monotonic()
        clock = asyncio.create_task(self.follow_phases(t0))
        for i, (at, k) in enumerate(plan):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(client, i, k, at, t0)))
        await clock
        self.phase = "tail"
        done, pending = await asyncio.wait(tasks, timeout=self.a.tail_timeout) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        records = [t.result() if t in done else {"i": i, "phase": plan[i][1], "at": round(plan[i][0], 3),
                                                 "error": "unfinished"} for i, t in enumerate(tasks)]
        await client.close()
        return records, len(pending)


def whole(rec: dict, osl: int) -> bool:
    """All its tokens, ended by max_tokens, under one response id (a migrated stream keeps its id)."""
    return rec["finish_reason"] == "length" and rec["completion_tokens"] == osl and len(rec["ids"]) == 1


# --------------------------------------------------------------------------- watching the fleet
def get_json(url: str, timeout: float = 3.0) -> tuple[int | None, object]:
    """(status, body); (None, None) while nothing listens (a process starting or gone)."""
    try:
        return http_get_json(url, timeout)
    except OSError:
        return None, None


def metric(samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


class Sampler(threading.Thread):
    """Every `sample_s`: the planner's replicas per role, the frontend's workers, the client's requests in
    flight, each worker process of the planner (role, asleep, its requests, on vLLM its NIXL series), and
    every 5th sample the GPUs' memory."""

    def __init__(self, a, planner_pid: int, planner_url: str, frontend_url: str, load: Load):
        super().__init__(daemon=True)
        self.a, self.planner_pid, self.planner_url, self.frontend_url, self.load = \
            a, planner_pid, planner_url, frontend_url, load
        self.series: list[dict] = []
        self.workers: dict[int, dict] = {}  # pid -> role, port, first/last seen, asleep seen, last metrics
        self.gpu_memory: list[dict] = []
        self.stopping = threading.Event()
        self.t0 = time.monotonic()
        self.nvidia_smi = shutil.which("nvidia-smi")

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            try:
                self.sample(n)
            except Exception as exc:  # noqa: BLE001 (a sample lost is not the run lost)
                log(f"sample failed: {type(exc).__name__}: {exc}")
            n += 1
            self.stopping.wait(self.a.sample_s)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def sample(self, n: int) -> None:
        pm = scrape(f"{self.planner_url}/metrics")
        _, fe = get_json(f"{self.frontend_url}/health")
        fe = fe if isinstance(fe, dict) else {}
        row = {"t": self.now(), "phase": self.load.phase, "inflight": self.load.inflight,
               "decision_id": int(metric(pm, "turbine_planner_decision_id")),
               "frontend": {"prefill": (fe.get("prefill_workers") or {}).get(SERVED, 0),
                            "decode": (fe.get("models") or {}).get(SERVED, 0)}}
        for what in ("current", "starting", "sleeping", "target"):
            row[what] = {r: int(metric(pm, f"turbine_planner_{what}_replicas", role=r)) for r in ROLES}
        row["asleep"] = self.sample_workers()
        self.series.append(row)
        if self.nvidia_smi and n % 5 == 0:
            self.gpu_memory.append({"t": self.now(), "used_mib": gpu_memory_used(self.nvidia_smi)})

    def sample_workers(self) -> list[str]:
        """Scrapes each live worker of the planner; returns the names of those asleep."""
        import psutil

        try:
            children = psutil.Process(self.planner_pid).children()
        except psutil.Error:
            children = []
        asleep = []
        for c in children:
            try:
                cmd = c.cmdline()
            except psutil.Error:
                continue
            if not any(m in cmd for m in ("turbine.vllm", "turbine.mocker")):
                continue
            w = self.workers.setdefault(c.pid, {"name": f"{flag_value(cmd, '--disaggregation-mode')}-{c.pid}",
                                                "role": flag_value(cmd, "--disaggregation-mode"),
                                                "port": int(flag_value(cmd, "--system-port") or 0),
                                                "first_seen": self.now(), "asleep_seen": False})
            w["last_seen"] = self.now()
            _, body = get_json(f"http://127.0.0.1:{w['port']}/engine/is_sleeping", timeout=2)
            if isinstance(body, dict) and body.get("is_sleeping"):
                w["asleep_seen"] = True
                asleep.append(w["name"])
            samples = scrape(f"http://127.0.0.1:{w['port']}/metrics")
            if samples:  # cumulative per process: the last scrape is its total (it vanishes with the process)
                w["metrics"] = worker_counts(samples)
        return asleep


def flag_value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd and cmd.index(flag) + 1 < len(cmd) else None


def worker_counts(samples) -> dict:
    """A worker's requests by outcome, the prompt tokens its vLLM got by source (external_kv_transfer: pulled
    over NIXL) and every NIXL series summed over labels (the release decides which exist)."""
    out: dict = {"requests": {}, "prompt_tokens_by_source": {}, "nixl": {}}
    for name, labels, v in samples:
        if name == "turbine_worker_requests_total":
            key = labels.get("outcome", "?")
            out["requests"][key] = out["requests"].get(key, 0) + v
        elif name == "vllm:prompt_tokens_by_source_total":
            key = labels.get("source", "?")
            out["prompt_tokens_by_source"][key] = out["prompt_tokens_by_source"].get(key, 0) + v
        elif "nixl" in name and not name.endswith(("_bucket", "_created")):
            out["nixl"][name] = out["nixl"].get(name, 0.0) + v
    return out


def gpu_memory_used(nvidia_smi: str) -> list[int] | None:
    try:
        q = subprocess.run([nvidia_smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return [int(x) for x in q.stdout.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


# --------------------------------------------------------------------------- the planner's log
DECISION = re.compile(r"decision (\d+) \((\w+) path\): (\{[^}]*\}) -> (\{[^}]*\})")
CONNECTOR_MARKERS = ("decision ", "started ", "registered after", "became ready", "asleep (level", "woken",
                     "exited", "could not sleep", "did not wake", "still runs", "failed to apply", "killing")


def planner_events(text: str) -> dict:
    """The planner's decisions (id, path, from, to) and the connector's actions, from its log."""
    decisions = [{"id": int(m[1]), "path": m[2], "from": m[3], "to": m[4]} for m in DECISION.finditer(text)]
    actions = [line[:300] for line in text.splitlines()
               if any(k in line for k in CONNECTOR_MARKERS) and not DECISION.search(line)]
    return {"decisions": decisions, "actions": actions,
            "intervals": [line[:200] for line in text.splitlines() if "interval:" in line]}


# --------------------------------------------------------------------------- summary
def phase_stats(a, records: list[dict]) -> list[dict]:
    out = []
    for k, ph in enumerate(a.phase_list):
        mine = [r for r in records if r["phase"] == k]
        ok = [r for r in mine if r["error"] is None]
        ttft = [r["ttft"] * 1000 for r in ok if r.get("ttft") is not None]
        out.append({"phase": f"{ph.name}#{k}", "rps": ph.rps, "seconds": ph.seconds, "sent": len(mine),
                    "whole": len(ok), "lost": len(mine) - len(ok),
                    "ttft_p50_ms": _round(pct(ttft, 50)), "ttft_p99_ms": _round(pct(ttft, 99))})
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def timeline(series: list[dict]) -> list[str]:
    """The samples where the decode role's state changed, one line each."""
    lines, last = [], None
    for s in series:
        key = (s["current"]["decode"], s["starting"]["decode"], s["sleeping"]["decode"], s["target"]["decode"],
               s["frontend"]["decode"], s["current"]["prefill"], s["frontend"]["prefill"])
        if key != last:
            lines.append(f"t={s['t']:6.1f}s {s['phase']:>8}: decode ready {key[0]} starting {key[1]} asleep {key[2]} "
                         f"target {key[3]} (frontend {key[4]}); prefill ready {key[5]} (frontend {key[6]}); "
                         f"in flight {s['inflight']}, decision {s['decision_id']}")
            last = key
    return lines


def checks(a, doc: dict) -> dict[str, bool]:
    """What the run must show (issue #30 §3): nothing lost, the decode role up (the added worker served) and back
    down after the peak, KV moved."""
    series, reqs = doc["series"], doc["requests"]
    decode_ready = [s["current"]["decode"] for s in series]
    peak = max(decode_ready, default=0)
    after_peak = decode_ready[decode_ready.index(peak):] if peak else []
    decoders = [w for w in doc["workers"].values() if w["role"] == "decode"]
    served = [w for w in decoders if sum((w.get("metrics") or {}).get("requests", {}).values()) > 0]
    out = {"no request lost": reqs["sent"] > 0 and reqs["lost"] == 0,
           "decode scaled up (a second decode worker served)": peak >= 2 and len(served) >= 2
           and max(s["frontend"]["decode"] for s in series) >= 2,
           "decode scaled down after the peak": peak >= 2 and min(after_peak) < peak}
    remote = doc["frontend"]["prefills"].get("remote", 0)
    if a.engine == "vllm":
        pulled = sum(w.get("metrics", {}).get("prompt_tokens_by_source", {}).get("external_kv_transfer", 0)
                     for w in decoders)
        out["KV moved (remote prefills, tokens pulled over NIXL)"] = remote > 0 and pulled > 0
    else:
        out["KV moved (remote prefills)"] = remote > 0
    return out


# --------------------------------------------------------------------------- run
def run(a, run_dir: Path, doc: dict) -> None:
    profile_path = str(run_dir / "profile.json")
    if a.profile:
        shutil.copy(a.profile, profile_path)
    else:
        Path(profile_path).write_text(dump_json(synthetic_profile(a)))
    stack = Stack("planner", run_dir, "gpu_planner")
    disc = str(run_dir / "discovery")
    env = turbine_env(disc, TURBINE_DISCOVERY_TTL="3")
    env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)  # each worker claims its own (turbine/vllm/connectors.py)
    planner_port = free_port()
    planner_url = f"http://127.0.0.1:{planner_port}"
    cfg = planner_config(a, run_dir, profile_path, stack.base_url, planner_port)
    (run_dir / "planner.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    doc["planner_config"] = cfg
    load = Load(a, stack.base_url)
    sampler = None
    planner = None
    aborted = False
    try:
        stack.spawn("frontend", [sys.executable, "-m", "turbine.frontend", "--http-port", str(stack.port),
                                 "--router-mode", "round-robin", "--migration-limit", str(a.migration_limit),
                                 "--max-local-prefill-length", "0", *a.frontend_args.split()], env)
        planner = stack.spawn("planner", [sys.executable, "-m", "turbine.planner", "--config",
                                          str(run_dir / "planner.yaml")], env)
        sampler = Sampler(a, planner.popen.pid, planner_url, stack.base_url, load)
        sampler.start()

        def ready() -> bool:
            if dead := [w["name"] for pid, w in sampler.workers.items() if not running(pid)]:
                raise RuntimeError(f"{', '.join(dead)} exited before the fleet served (the planner would wait for "
                                   f"it until --start-timeout):\n{worker_logs(run_dir)}")
            status, _ = http_get_json(f"{planner_url}/health")
            _, fe = http_get_json(f"{stack.base_url}/health")
            return (status == 200 and isinstance(fe, dict) and (fe.get("models") or {}).get(SERVED) == 1
                    and (fe.get("prefill_workers") or {}).get(SERVED) == 1)

        stack.wait_ready(ready, a.start_timeout)
        doc["start_s"] = round(stack.startup_s, 1)
        plan = arrivals(a)
        log(f"{len(plan)} requests over {sum(p.seconds for p in a.phase_list):g}s: "
            + ", ".join(f"{p.name} {p.rps:g}/s x {p.seconds:g}s" for p in a.phase_list))
        records, unfinished = asyncio.run(load.run(plan))
        time.sleep(2 * a.sample_s)  # one more look at the fleet after the last request
        lost = [r for r in records if r["error"] is not None]
        doc["requests"] = {"sent": len(plan), "recorded": len(records), "whole": len(records) - len(lost),
                           "lost": len(plan) - (len(records) - len(lost)), "unfinished": unfinished,
                           "errors": sorted({r["error"] for r in lost})[:10]}
        doc["phases"] = phase_stats(a, records)
        doc["requests_raw"] = [(r["i"], r["phase"], r["at"], _round(r["ttft"] * 1000) if r.get("ttft") else None,
                                r.get("seconds"), r["error"]) for r in records]
        fm = scrape(f"{stack.base_url}/metrics")
        doc["frontend"] = {"prefills": {w: metric(fm, "turbine_frontend_prefills_total", where=w)
                                        for w in ("remote", "local", "local_fallback")},
                           "migrations": metric(fm, "turbine_frontend_migrations_total")}
        pm = scrape(f"{planner_url}/metrics")
        doc["planner_decisions_total"] = {f"{lab.get('path')}/{lab.get('role')}/{lab.get('direction')}": v
                                          for n, lab, v in pm if n == "turbine_planner_decisions_total"}
        doc["planner_errors_total"] = {lab.get("where"): v for n, lab, v in pm if n == "turbine_planner_errors_total"}
    except BaseException:
        # SIGTERM (the step's timeout: SIGKILL follows 30 s later) or an error: stop fast, what outlives it is killed.
        aborted = True
        raise
    finally:
        if "requests" not in doc and load.done:  # cut short (SIGTERM, an error): what had finished
            doc["requests_partial"] = {"finished": len(load.done),
                                       "lost": sum(r["error"] is not None for r in load.done),
                                       "errors": sorted({r["error"] for r in load.done if r["error"]})[:10]}
        if sampler is not None:
            sampler.stopping.set()
            sampler.join(5 if aborted else 30)
        # The planner's SIGTERM stops its workers (each drains) before it exits.
        stack.stop(timeout=15 if aborted else a.drain_timeout + 90)
        if sampler is not None:
            doc["orphans_killed"] = stop_leftovers(sampler.workers)
            doc["series"] = sampler.series
            doc["workers"] = {str(pid): w for pid, w in sampler.workers.items()}
            doc["gpu_memory_mib"] = sampler.gpu_memory
        if planner is not None:
            doc["planner_exit_code"] = planner.popen.returncode
            doc["planner"] = planner_events(planner.log_path.read_text(errors="replace"))


def running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def worker_logs(run_dir: Path, lines: int = 30) -> str:
    return "\n".join(f"--- {p}\n{tail(p, lines)}" for p in sorted((run_dir / "workers").glob("*.log")))


def stop_leftovers(workers: dict[int, dict]) -> list[str]:
    """Worker processes the planner started that outlived it (killed with their process group: each is its
    own session's leader); their names. Only pids seen as the planner's children, still running a worker."""
    import psutil

    killed = []
    for pid, w in workers.items():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if f"{w['port']}" in cmd and any(m in cmd for m in ("turbine.vllm", "turbine.mocker")):
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(w["name"])
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    exit_on_sigterm()
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="gpu_planner_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                 "commit": git_commit(), "run_dir": str(run_dir),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "phase_list"},
                 "phases_planned": [vars(p) for p in a.phase_list]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = 1
    try:
        run(a, run_dir, doc)
    finally:
        if "series" in doc:
            doc["timeline"] = timeline(doc["series"])
        if "requests" in doc and "series" in doc:
            doc["checks"] = checks(a, doc)
            result = 0 if all(doc["checks"].values()) else 1
        a.out.write_text(dump_json(doc))
        report(doc)
        log(f"wrote {a.out} (logs in {run_dir})")
    return result


def report(doc: dict) -> None:
    """The summary on stdout: requests, phases, the decode role's timeline, decisions, KV, checks."""
    if "requests" in doc:
        print(f"requests: {doc['requests']}")
        for ph in doc.get("phases", []):
            print(f"  {ph}")
    for line in doc.get("timeline", []):
        print(line)
    planner = doc.get("planner", {})
    for d in planner.get("decisions", []):
        print(f"decision {d['id']} ({d['path']}): {d['from']} -> {d['to']}")
    for line in planner.get("actions", []):
        what = line.split(": ", 1)[-1]
        print(f"  {line[11:19]} {what.split('): ', 1)[0] + ')' if what.startswith('started ') else what}")
    if "planner_decisions_total" in doc:
        print(f"turbine_planner_decisions_total: {doc['planner_decisions_total']}; errors {doc['planner_errors_total']}")
    if "frontend" in doc:
        print(f"frontend: prefills {doc['frontend']['prefills']}, migrations {doc['frontend']['migrations']}")
    for w in doc.get("workers", {}).values():
        m = w.get("metrics") or {}
        nixl = m.get("nixl") or {}
        moved = (f"{nixl.get('vllm:nixl_xfer_time_seconds_count', 0):g} transfers, "
                 f"{nixl.get('vllm:nixl_bytes_transferred_sum', 0) / 2**30:.2f} GiB, "
                 f"{nixl.get('vllm:nixl_num_failed_transfers_total', 0):g} failed") if nixl else "-"
        print(f"worker {w['name']}: seen {w['first_seen']}-{w.get('last_seen')}s, asleep seen {w['asleep_seen']}, "
              f"requests {m.get('requests')}, prompt tokens by source {m.get('prompt_tokens_by_source') or '-'}, "
              f"NIXL {moved}")
    if doc.get("orphans_killed"):
        print(f"workers left by the planner, killed: {doc['orphans_killed']}")
    for name, ok in doc.get("checks", {}).items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")


if __name__ == "__main__":
    sys.exit(main())

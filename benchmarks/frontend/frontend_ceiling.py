#!/usr/bin/env python3
r"""Frontend ceiling: Turbine's frontend vs NVIDIA Dynamo 1.6.1's, each in front of its own mocker
with no simulated delay, so the frontend (plus aiperf on the same cores) is the bottleneck.

  turbine  python -m turbine.frontend + python -m turbine.mocker --speedup-ratio 0
  dynamo   python -m dynamo.frontend  + python -m dynamo.mocker --speedup-ratio 1000
           (file discovery, TCP request plane, ZMQ event plane through a local XSUB/XPUB broker,
           everything on loopback: the recipe of ../shared/peer/README.md; in 1.6.1
           --speedup-ratio 0 behaves like 1, so 1000 stands for "no delay")

The load is the peer's bench.sh load, through frontend_overhead's aiperf runner: streaming
chat, 200 synthetic input / 64 output tokens, ignore_eos, output tokens from usage, warmup
max(2, C) requests, concurrency 1, 8, 32, max(300, 40 x C) measured requests.  The systems alternate (ABBA by default); the
reported values are medians over repeats, with per-repeat ratios in the JSON.  The CPU
seconds each process used during each point are recorded too.

  turbine-base  the same as turbine, from another Turbine checkout (--turbine-baseline PATH, env
           TURBINE_BASELINE), run with this venv's python and PYTHONPATH=PATH (plus PYTHONSAFEPATH=1,
           so the current directory does not shadow it): this version against an older one, in the
           same sitting, alternating with the others.  Which checkout each system really imported
           (and its commit) is checked before measuring and recorded in the JSON.

--systems picks and orders the systems (default turbine,dynamo; turbine,turbine-base,dynamo when a
baseline is given).  Ratios are the first system (normally turbine) over each other one.

--py-spy PATH: afterwards, start Turbine once more and record its frontend with py-spy during
one extra point (not part of the measurement) and write the raw stacks plus a top-N summary.

--cluster-key: instead, the cost of the cluster key (turbine/runtime/cluster_auth.py): two stacks up
side by side, `turbine-key` (frontend and mocker share TURBINE_CLUSTER_KEY) and `turbine` (none),
both with the KV router (so the event plane's signatures are checked), the built-in load below,
alternating point by point (ABBA over repeats); the CPU seconds of both processes are recorded.

--request-planes: instead, the NATS request plane against the TCP one: two stacks up side by side,
`turbine-nats` (frontend and mocker with TURBINE_REQUEST_PLANE=nats, through a private nats-server that
is one of the stack's processes) and `turbine` (tcp), the built-in load below, alternating point by
point (ABBA over repeats); the CPU seconds of every process (the nats-server's too) are recorded, and
what NATS costs per request is the difference of the stacks' total CPU per request.

--tools: instead, the cost of tool calling. One Turbine stack (the mocker with --reply-text, so that
every answer is the same hermes tool call, and --dyn-tool-call-parser hermes) serves two systems
that alternate point by point (ABBA over repeats): `turbine` (requests without tools: the reply
is plain content, no parser runs) and `turbine-tools` (the same requests with `tools`: the hermes
parser turns every answer into a tool call, checked on every response). The load is a built-in
async httpx generator (streaming chat, include_usage), no aiperf needed; numbers are only compared
within one run.

Paths come from flags or environment variables (AIPERF, DYNAMO_PYTHON, TURBINE_BASELINE,
TURBINE_PEER_DIR, PY_SPY), by default from this checkout: `make bench-tools` (aiperf in .bench-venv)
and `make bench-peer` (Dynamo and py-spy in .peer-venv), for example:

  make bench-tools bench-peer
  .venv/bin/python -m benchmarks.frontend.frontend_ceiling --turbine-baseline ../baseline-b979bab \
      --systems turbine,turbine-base,dynamo --repeats 3 --py-spy .peer-venv/bin/py-spy
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.lib.aiperf import aiperf_point
from benchmarks.lib.args import parse_int_list
from benchmarks.lib.paths import (
    REPO_ROOT, default_aiperf, default_dynamo_python, default_model, shared_path, versions
)
from benchmarks.lib.proc import log, proc_cpu_s
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.stack import Stack, checkout_env, start_nats, start_turbine, turbine_origin
from benchmarks.lib.stats import fmt, median, ratio
from turbine.runtime.ports import free_port


SERVED = "smollm2-135m-instruct"
# The peer's recipe and its zmq_broker.py: --peer-dir, $TURBINE_PEER_DIR, else the project's shared/
# folder beside this checkout.
DEFAULT_PEER_DIR = shared_path("peer")
SYSTEMS = ("turbine", "turbine-base", "dynamo")
METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "request_per_s")


def system_env(a, system: str) -> dict[str, str]:
    return checkout_env(a.turbine_baseline) if system == "turbine-base" else {}


def start_turbine_stack(a, run_dir: Path, tag: str, system: str = "turbine") -> Stack:
    st = Stack(system, run_dir, tag)
    start_turbine(st, a.python, ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
                                 "--speedup-ratio", "0", "--system-port", str(free_port()), *a.turbine_mocker_args.split()],
                  env=system_env(a, system))
    _ready_or_stop(st, lambda: st.models_ready(SERVED, True), a.startup_timeout)
    return st


def start_dynamo_stack(a, run_dir: Path, tag: str) -> Stack:
    st = Stack("dynamo", run_dir, tag)
    peer = Path(tempfile.mkdtemp(prefix="dynamo_", dir=run_dir))
    (peer / "home").mkdir()
    xsub, xpub = free_port(), free_port()
    env = dict(os.environ,
               DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(peer / "dynkv"), DYN_REQUEST_PLANE="tcp",
               DYN_EVENT_PLANE="zmq", DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
               DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1",
               DYN_ZMQ_BROKER_URL=f"xsub=tcp://127.0.0.1:{xsub},xpub=tcp://127.0.0.1:{xpub}",
               HOME=str(peer / "home"), DYN_SELF_HOST_METADATA="0", HF_HUB_OFFLINE="1")
    py = a.dynamo_python
    st.spawn("broker", [py, str(Path(a.peer_dir) / "zmq_broker.py"), str(xsub), str(xpub)], env)
    time.sleep(1)
    st.spawn("frontend", [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(st.port)], env)
    st.spawn("worker", [py, "-m", "dynamo.mocker", "--model-path", a.model, "--model-name", SERVED,
                        "--speedup-ratio", str(a.dynamo_speedup), *a.dynamo_mocker_args.split()], env)
    _ready_or_stop(st, lambda: st.models_ready(SERVED, False), a.startup_timeout)
    return st


def _ready_or_stop(st: Stack, ready, timeout: float) -> None:
    """Wait for readiness and one sanity request; a stack that fails is stopped here (the caller
    never gets it, so it could not stop the processes that did start)."""
    try:
        st.wait_ready(ready, timeout)
        st.sanity_check(SERVED)
    except BaseException:
        st.stop()
        raise


def requests_for(a, c: int) -> int:
    return max(a.min_requests, a.requests_multiplier * c)


def run_point(a, st: Stack, c: int, rep: int, run_dir: Path, seed_offset: int = 0) -> dict:
    tag = f"r{rep}_{st.name}_c{c}"
    cpu0 = {p.name.split()[-1]: proc_cpu_s(p.popen.pid) for p in st.procs}
    rec = aiperf_point(aiperf=a.aiperf, url=st.base_url, model=SERVED, tokenizer=a.model, concurrency=c,
                       requests=requests_for(a, c), warmup=max(2, c), isl=a.isl, osl=a.osl, seed=a.seed + seed_offset,
                       artifact_dir=run_dir / tag, log_path=run_dir / f"{tag}_aiperf.log", timeout=a.point_timeout)
    cpu1 = {p.name.split()[-1]: proc_cpu_s(p.popen.pid) for p in st.procs}
    rec["cpu_s"] = {k: (cpu1[k] - cpu0[k]) if cpu0.get(k) is not None and cpu1.get(k) is not None else None
                    for k in cpu1}
    rec.update({"repeat": rep, "system": st.name})
    m = rec["metrics"]
    if rec["ok"]:
        log(f"{tag}: {m['output_tok_s']:.0f} tok/s, TTFT p50 {m['ttft_p50_ms']:.1f} p99 {m['ttft_p99_ms']:.1f} ms, "
            f"ITL p50 {m['itl_p50_ms']:.2f} ms, cpu {rec['cpu_s']} ({rec['wall_s']:.0f}s)")
    return rec


def _cpu_ms_per_request(r: dict) -> float | None:
    cpu = (r.get("cpu_s") or {}).get("frontend")
    return cpu * 1000 / (r["metrics"].get("requests") or r["requests"]) if cpu is not None else None


def summarize(runs: list[dict], concs: list[int], systems: list[str]) -> dict:
    """Per concurrency: each system's medians over repeats, and the first system over each other
    one (medians' ratios and every repeat's own ratio)."""
    ref = systems[0]
    summary = {}
    for c in concs:
        row = {}
        for s in systems:
            ok = [r for r in runs if r["system"] == s and r["concurrency"] == c and r["ok"]]
            row[s] = {k: median([r["metrics"][k] for r in ok if r["metrics"].get(k) is not None]) for k in METRICS}
            row[s]["n_ok_runs"] = len(ok)
            row[s]["frontend_cpu_ms_per_request"] = median(
                [x for r in ok if (x := _cpu_ms_per_request(r)) is not None])
        ratios = {}
        for o in systems[1:]:
            rr = {k: ratio(row[ref][k], row[o][k]) for k in (*METRICS, "frontend_cpu_ms_per_request")}
            per_tok, per_cpu = [], []
            for rep in sorted({r["repeat"] for r in runs}):
                pair = {r["system"]: r for r in runs if r["repeat"] == rep and r["concurrency"] == c and r["ok"]}
                if ref in pair and o in pair:
                    per_tok.append(ratio(pair[ref]["metrics"]["output_tok_s"], pair[o]["metrics"]["output_tok_s"]))
                    per_cpu.append(ratio(_cpu_ms_per_request(pair[ref]), _cpu_ms_per_request(pair[o])))
            rr["per_repeat_throughput_ratio"] = per_tok
            rr["per_repeat_frontend_cpu_ratio"] = per_cpu
            ratios[f"{ref}/{o}"] = rr
        row["ratios"] = ratios
        if "turbine/dynamo" in ratios:  # the keys of earlier results
            d = ratios["turbine/dynamo"]
            row["throughput_ratio"], row["ttft_p50_ratio"], row["ttft_p99_ratio"] = (
                d["output_tok_s"], d["ttft_p50_ms"], d["ttft_p99_ms"])
            row["per_repeat_throughput_ratio"] = d["per_repeat_throughput_ratio"]
        summary[str(c)] = row
    return summary


def markdown(summary: dict, runs: list[dict], systems: list[str]) -> str:
    lines = ["| C | system | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | frontend CPU ms/request | runs |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c, row in summary.items():
        for s in systems:
            t = row[s]
            lines.append(f"| {c} | {s} | {fmt(t['output_tok_s'], 0)} | {fmt(t['ttft_p50_ms'])} | {fmt(t['ttft_p99_ms'])} "
                         f"| {fmt(t['itl_p50_ms'], 2)} | {fmt(t['frontend_cpu_ms_per_request'], 2)} | {t['n_ok_runs']} |")
    lines += ["", "Ratios (medians over repeats; per-repeat ratios of the same repeat's runs):", "",
              "| C | ratio | **tok/s** | TTFT p50 | TTFT p99 | ITL p50 | frontend CPU/request | per-repeat tok/s | per-repeat CPU/request |",
              "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for c, row in summary.items():
        for name, rr in row["ratios"].items():
            per = ", ".join(fmt(x, 2) for x in rr["per_repeat_throughput_ratio"])
            per_cpu = ", ".join(fmt(x, 2) for x in rr["per_repeat_frontend_cpu_ratio"])
            lines.append(f"| {c} | {name} | **{fmt(rr['output_tok_s'], 2)}** | {fmt(rr['ttft_p50_ms'], 2)} "
                         f"| {fmt(rr['ttft_p99_ms'], 2)} | {fmt(rr['itl_p50_ms'], 2)} "
                         f"| {fmt(rr['frontend_cpu_ms_per_request'], 2)} | {per} | {per_cpu} |")
    lines += ["", "Per run:", "", "| repeat | system | C | ok | tok/s | TTFT p50 | TTFT p99 | ITL p50 | CPU s (per process) | frontend CPU ms/request | wall s |",
              "|---:|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        m = r.get("metrics") or {}
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in (r.get("cpu_s") or {}).items() if v is not None)
        per_req = _cpu_ms_per_request(r) if m else None
        lines.append(f"| {r['repeat']} | {r['system']} | {r['concurrency']} | {'yes' if r['ok'] else 'NO'} "
                     f"| {fmt(m.get('output_tok_s'), 0)} | {fmt(m.get('ttft_p50_ms'))} | {fmt(m.get('ttft_p99_ms'))} "
                     f"| {fmt(m.get('itl_p50_ms'), 2)} | {cpu} | {fmt(per_req, 2)} | {fmt(r.get('wall_s'), 0)} |")
    return "\n".join(lines)


def summarize_raw_stacks(raw: Path, top: int = 25) -> dict:
    """py-spy --format raw: 'frame;frame;... count' lines.  Self and inclusive sample shares per function."""
    self_c, incl_c, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        self_c[frames[-1]] += n
        for f in set(frames):
            incl_c[f] += n
    return {"samples": total,
            "self_top": [(f, round(100 * n / total, 1)) for f, n in self_c.most_common(top)] if total else [],
            "inclusive_top": [(f, round(100 * n / total, 1)) for f, n in incl_c.most_common(top)] if total else []}


def profile_turbine(a, run_dir: Path, out_dir: Path) -> dict:
    wait_quiet()
    st = start_turbine_stack(a, run_dir, "pyspy_turbine")
    fe = next(p for p in st.procs if p.name.endswith("frontend"))
    stamp = _dt.date.today().isoformat()
    raw = out_dir / f"frontend_ceiling-pyspy-{stamp}.txt"
    svg = out_dir / f"frontend_ceiling-pyspy-{stamp}.svg"
    c = a.py_spy_concurrency
    try:
        res = {}
        for i, (fmt_, path) in enumerate((("raw", raw), ("flamegraph", svg))):
            spy = subprocess.Popen([a.py_spy, "record", "--pid", str(fe.popen.pid), "--duration", str(a.py_spy_seconds),
                                    "--rate", "100", "--format", fmt_, "--output", str(path), "--nonblocking"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            time.sleep(1)
            rec = run_point(a, st, c, -1 - i, run_dir, seed_offset=7 + i)
            spy_out = spy.communicate(timeout=a.py_spy_seconds + 60)[0]
            res[fmt_] = {"path": str(path), "pyspy_log": spy_out[-2000:], "point": rec["metrics"]}
        res["summary"] = summarize_raw_stacks(raw) if raw.exists() else None
        return res
    finally:
        st.stop()


# -- --tools: tool-call parsing vs plain, on one stack ---------------------------------------------
TOOL_REPLY = ('<tool_call>{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius", '
              '"days": 3, "details": ["temperature", "wind", "humidity", "precipitation"]}}</tool_call>')
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"},
        "details": {"type": "array", "items": {"type": "string"}}}}}}
TOOL_SYSTEMS = ("turbine", "turbine-tools")


async def _load(url: str, c: int, requests: int, tools: bool, isl_words: int, max_tokens: int = 256,
                expect: str | None = TOOL_REPLY) -> dict:
    """`requests` streamed chat requests, `c` at a time; every response checked for its shape
    (`expect` None: any text, ended by length or stop)."""
    import asyncio

    import httpx

    from benchmarks.lib.load import sse_chunks

    body = {"model": SERVED, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": " ".join(["word"] * isl_words)}]}
    if tools:
        body["tools"] = [WEATHER_TOOL]
    todo = iter(range(requests))
    tokens, bad, ttfts = [0], [], []

    async def one(client, i: int) -> None:
        b = dict(body, messages=[{"role": "user", "content": f"{i} " + body["messages"][0]["content"]}])
        start = time.monotonic()
        first, calls, content, finish = None, 0, "", None
        async for chunk in sse_chunks(client, f"{url}/v1/chat/completions", b):
            for ch in chunk.get("choices") or ():
                d = ch.get("delta") or {}
                if first is None and (d.get("content") or d.get("tool_calls")):
                    first = time.monotonic() - start
                content += d.get("content") or ""
                calls += sum(1 for t in d.get("tool_calls") or () if t.get("id"))
                finish = ch.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens[0] += chunk["usage"]["completion_tokens"]
        ttfts.append(first or 0.0)
        if expect is None:
            ok = calls == 0 and bool(content) and finish in ("length", "stop")
        else:
            ok = (calls == 1 and not content and finish == "tool_calls") if tools else (
                calls == 0 and content == expect and finish == "stop")
        if not ok:
            bad.append((calls, content[:80], finish))

    async def worker(client) -> None:
        for i in todo:
            await one(client, i)

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for i in range(max(2, c)):  # warm-up
            await one(client, -1 - i)
        tokens[0], bad[:], ttfts[:] = 0, [], []
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.monotonic() - start
    ttfts.sort()
    return {"ok": not bad, "bad_responses": bad[:5], "n_bad": len(bad), "wall_s": wall,
            "metrics": {"output_tok_s": tokens[0] / wall, "request_per_s": requests / wall,
                        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "requests": requests}}


def run_tools(a, parser: argparse.ArgumentParser) -> int:
    import asyncio

    a.model = a.model or default_model(a.python)
    a.turbine_mocker_args = f"{a.turbine_mocker_args} --dyn-tool-call-parser hermes"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-frontend-ceiling-tools-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    st = Stack("turbine", run_dir, "tools")
    start_turbine(st, a.python, ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
                                 "--speedup-ratio", "0", "--system-port", str(free_port()), "--reply-text", TOOL_REPLY,
                                 *a.turbine_mocker_args.split()])
    _ready_or_stop(st, lambda: st.models_ready(SERVED, True), a.startup_timeout)
    runs, started = [], time.time()
    try:
        for rep in range(a.repeats):
            order = TOOL_SYSTEMS if (a.order == "abab" or rep % 2 == 0) else TOOL_SYSTEMS[::-1]
            for c in a.concurrency:
                for s in order:
                    fe = next(p for p in st.procs if p.name.endswith("frontend"))
                    cpu0 = proc_cpu_s(fe.popen.pid)
                    rec = asyncio.run(_load(st.base_url, c, requests_for(a, c), s == "turbine-tools", a.isl))
                    cpu1 = proc_cpu_s(fe.popen.pid)
                    rec.update({"repeat": rep, "system": s, "concurrency": c, "requests": requests_for(a, c),
                                "cpu_s": {"frontend": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None}})
                    runs.append(rec)
                    m = rec["metrics"]
                    log(f"r{rep} {s} c{c}: {m['output_tok_s']:.0f} tok/s, {m['request_per_s']:.1f} req/s, "
                        f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, frontend cpu {rec['cpu_s']['frontend']}, "
                        f"bad {rec['n_bad']}")
    finally:
        st.stop()
    summary = summarize(runs, a.concurrency, list(TOOL_SYSTEMS[::-1]))
    table = markdown(summary, runs, list(TOOL_SYSTEMS[::-1]))
    print(table)
    out = Path(a.out.replace("frontend_ceiling-", "frontend_ceiling_tools-"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "turbine_frontend_ceiling_tools", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "reply": TOOL_REPLY,
        "config": vars(a), "summary": summary, "runs": runs, "markdown": table}, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0 if all(r["ok"] for r in runs) else 1


# -- --responses: the Responses API (stored) vs Chat Completions, on one stack ----------------------

RESPONSES_SYSTEMS = ("turbine", "turbine-responses")


async def _responses_load(url: str, c: int, requests: int, responses: bool, isl_words: int, osl: int) -> dict:
    """`requests` streamed requests, `c` at a time: chat completions (include_usage), or Responses
    (stored: the frontend saves each before its last event); every answer checked."""
    import asyncio
    import json as _json

    import httpx

    words = " ".join(["word"] * isl_words)
    todo = iter(range(requests))
    tokens, bad, ttfts = [0], [], []

    # The client shares the host's cores with the frontend: it decodes only what it checks (the first
    # text, the finish and the usage), for both APIs alike, so that the frontend stays the bottleneck.
    async def chat(client, i: int) -> tuple[float | None, str, str | None]:
        body = {"model": SERVED, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": osl,
                "messages": [{"role": "user", "content": f"{i} {words}"}]}
        start, first, text, finish = time.monotonic(), None, "", None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return None, f"HTTP {resp.status_code}", None
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if first is None or '"finish_reason":"' in line or '"usage":{' in line:
                    chunk = _json.loads(line[6:])
                    for ch in chunk.get("choices") or ():
                        piece = (ch.get("delta") or {}).get("content") or ""
                        if first is None and piece:
                            first, text = time.monotonic() - start, piece
                        finish = ch.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens[0] += chunk["usage"]["completion_tokens"]
        return first, text, finish

    async def response(client, i: int) -> tuple[float | None, str, str | None]:
        body = {"model": SERVED, "stream": True, "max_output_tokens": osl, "input": f"{i} {words}"}
        start, first, text, status, kind = time.monotonic(), None, "", None, ""
        async with client.stream("POST", f"{url}/v1/responses", json=body) as resp:
            if resp.status_code != 200:
                return None, f"HTTP {resp.status_code}", None
            async for line in resp.aiter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                    continue
                if not line.startswith("data: "):
                    continue
                if kind == "response.output_text.delta" and first is None:
                    first = time.monotonic() - start
                elif kind in ("response.completed", "response.incomplete"):
                    final = _json.loads(line[6:])["response"]
                    status, text = final["status"], final["output"][0]["content"][0]["text"]
                    tokens[0] += final["usage"]["output_tokens"]
                    if not final["store"]:
                        status = "not stored"
        return first, text, {"completed": "stop", "incomplete": "length"}.get(status, status)

    one = response if responses else chat

    async def checked(client, i: int) -> None:
        first, text, finish = await one(client, i)
        ttfts.append(first or 0.0)
        if not (text and finish in ("length", "stop")):
            bad.append((text[:80], finish))

    async def worker(client) -> None:
        for i in todo:
            await checked(client, i)

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for i in range(max(2, c)):  # warm-up
            await checked(client, -1 - i)
        tokens[0], bad[:], ttfts[:] = 0, [], []
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.monotonic() - start
    ttfts.sort()
    return {"ok": not bad, "bad_responses": bad[:5], "n_bad": len(bad), "wall_s": wall,
            "metrics": {"output_tok_s": tokens[0] / wall, "request_per_s": requests / wall,
                        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "requests": requests}}


def _store_seconds(base_url: str) -> dict[str, tuple[float, float]]:
    """The frontend's response-store histogram: op -> (sum of seconds, count)."""
    out: dict[str, list[float]] = {}
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            for suffix, slot in (("_sum", 0), ("_count", 1)):
                head = "turbine_frontend_response_store_seconds" + suffix + "{"
                if line.startswith(head):
                    op = line[len(head):].split('op="', 1)[1].split('"', 1)[0]
                    out.setdefault(op, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {op: (v[0], v[1]) for op, v in out.items()}


def run_responses(a) -> int:
    import asyncio

    a.model = a.model or default_model(a.python)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-frontend-ceiling-responses-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    st = Stack("turbine", run_dir, "responses")
    store = ["--response-store", a.response_store]
    if a.response_store == "nats":
        store += ["--response-store-nats-url", a.nats_url, "--response-store-bucket", f"bench-{stamp}",
                  "--response-store-ttl", "3600"]
    start_turbine(st, a.python, ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
                                 "--speedup-ratio", "0", "--system-port", str(free_port()),
                                 *a.turbine_mocker_args.split()], frontend_args=store)
    _ready_or_stop(st, lambda: st.models_ready(SERVED, True), a.startup_timeout)
    runs, started = [], time.time()
    try:
        for rep in range(a.repeats):
            order = RESPONSES_SYSTEMS if (a.order == "abab" or rep % 2 == 0) else RESPONSES_SYSTEMS[::-1]
            for c in a.concurrency:
                for s in order:
                    fe = next(p for p in st.procs if p.name.endswith("frontend"))
                    cpu0, store0 = proc_cpu_s(fe.popen.pid), _store_seconds(st.base_url)
                    rec = asyncio.run(_responses_load(st.base_url, c, requests_for(a, c), s == "turbine-responses",
                                                      a.isl, a.osl))
                    cpu1, store1 = proc_cpu_s(fe.popen.pid), _store_seconds(st.base_url)
                    ops = {op: (store1[op][0] - store0.get(op, (0, 0))[0], store1[op][1] - store0.get(op, (0, 0))[1])
                           for op in store1}
                    rec.update({"repeat": rep, "system": s, "concurrency": c, "requests": requests_for(a, c),
                                "cpu_s": {"frontend": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None},
                                "store_ms_per_op": {op: 1000 * t / n for op, (t, n) in ops.items() if n},
                                "store_ops": {op: n for op, (t, n) in ops.items() if n}})
                    runs.append(rec)
                    m = rec["metrics"]
                    log(f"r{rep} {s} c{c}: {m['output_tok_s']:.0f} tok/s, {m['request_per_s']:.1f} req/s, "
                        f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, frontend cpu {rec['cpu_s']['frontend']}, "
                        f"store ms/op {rec['store_ms_per_op']}, bad {rec['n_bad']}")
    finally:
        st.stop()
    summary = summarize(runs, a.concurrency, list(RESPONSES_SYSTEMS[::-1]))
    table = markdown(summary, runs, list(RESPONSES_SYSTEMS[::-1]))
    print(table)
    out = Path(a.out.replace("frontend_ceiling-", f"frontend_ceiling_responses_{a.response_store}-"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "turbine_frontend_ceiling_responses", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "response_store": a.response_store,
        "config": vars(a), "summary": summary, "runs": runs, "markdown": table}, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0 if all(r["ok"] for r in runs) else 1


# -- --cluster-key: the internal planes with a cluster key vs without ------------------------------

KEY_SYSTEMS = ("turbine-key", "turbine")


def run_cluster_key(a) -> int:
    """Two stacks up side by side (KV router, so that the event plane's signatures are checked on
    every load report and KV event), the same load on each, point by point, ABBA over repeats."""
    import secrets

    def env_of(system: str, st: Stack) -> dict[str, str]:
        return {"TURBINE_CLUSTER_KEY": secrets.token_hex(32)} if system == "turbine-key" else {}

    return run_side_by_side(a, KEY_SYSTEMS, env_of, ["--router-mode", "kv"], "cluster_key")


PLANE_SYSTEMS = ("turbine-nats", "turbine")


def run_request_planes(a) -> int:
    """The NATS request plane vs TCP: two stacks up side by side, the NATS one with its own nats-server."""
    def env_of(system: str, st: Stack) -> dict[str, str]:
        if system == "turbine-nats":
            return {"TURBINE_REQUEST_PLANE": "nats", "TURBINE_NATS_SERVER": start_nats(st)}
        return {"TURBINE_REQUEST_PLANE": "tcp"}

    return run_side_by_side(a, PLANE_SYSTEMS, env_of, [], "request_planes", cost_of="turbine-nats")


def _cpu_ms_per_request_all(r: dict) -> dict[str, float]:
    n = r["metrics"].get("requests") or r["requests"]
    cpu = r.get("cpu_s") or {}
    out = {k: v * 1000 / n for k, v in cpu.items() if v is not None}
    out["total"] = sum(out.values())
    return out


def cpu_cost_table(runs: list[dict], concs: list[int], systems: tuple[str, str]) -> tuple[dict, str]:
    """Per concurrency: each process's CPU ms per request (medians over repeats), and the first
    system's total minus the second's (per repeat, and its median): what the first costs per request."""
    first, second = systems
    rows, lines = {}, ["| C | system | frontend | worker | nats-server | **total CPU ms/request** |",
                       "|---:|---|---:|---:|---:|---:|"]
    for c in concs:
        row = {}
        for s in systems:
            per = [_cpu_ms_per_request_all(r) for r in runs if r["system"] == s and r["concurrency"] == c and r["ok"]]
            row[s] = {k: median([p.get(k) for p in per if p.get(k) is not None])
                      for k in ("frontend", "worker", "nats", "total")}
            t = row[s]
            lines.append(f"| {c} | {s} | {fmt(t['frontend'], 2)} | {fmt(t['worker'], 2)} | {fmt(t['nats'], 2)} "
                         f"| **{fmt(t['total'], 2)}** |")
        diffs = []
        for rep in sorted({r["repeat"] for r in runs}):
            pair = {r["system"]: r for r in runs if r["repeat"] == rep and r["concurrency"] == c and r["ok"]}
            if first in pair and second in pair:
                diffs.append(_cpu_ms_per_request_all(pair[first])["total"]
                             - _cpu_ms_per_request_all(pair[second])["total"])
        row["extra_total_ms_per_request"] = median(diffs)
        row["per_repeat_extra_ms"] = diffs
        rows[str(c)] = row
    lines += ["", f"{first} − {second}, total CPU ms per request (median; per repeat):", ""]
    lines += [f"- C = {c}: **{fmt(r['extra_total_ms_per_request'], 2)}** ({', '.join(fmt(x, 2) for x in r['per_repeat_extra_ms'])})"
              for c, r in rows.items()]
    return rows, "\n".join(lines)


def run_side_by_side(a, systems: tuple[str, str], env_of, frontend_args: list[str], label: str,
                     cost_of: str | None = None) -> int:
    """Two Turbine stacks (a frontend and a --speedup-ratio 0 mocker each) up side by side, `env_of(system,
    stack)` giving each its environment; the built-in load on each, point by point, ABBA over repeats."""
    import asyncio

    a.model = a.model or default_model(a.python)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-frontend-ceiling-{label}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stacks: dict[str, Stack] = {}
    runs, started = [], time.time()
    try:
        for s in systems:
            st = stacks[s] = Stack(s, run_dir, s)
            env = env_of(s, st)
            start_turbine(st, a.python, ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
                                         "--speedup-ratio", "0", "--system-port", str(free_port()),
                                         *a.turbine_mocker_args.split()],
                          frontend_args=frontend_args, env=env)
            _ready_or_stop(st, lambda: st.models_ready(SERVED, True), a.startup_timeout)
        for rep in range(a.repeats):
            order = systems if (a.order == "abab" or rep % 2 == 0) else systems[::-1]
            for c in a.concurrency:
                for s in order:
                    st = stacks[s]
                    wait_quiet()
                    cpu0 = {p.name.split()[-1]: proc_cpu_s(p.popen.pid) for p in st.procs}
                    rec = asyncio.run(_load(st.base_url, c, requests_for(a, c), False, a.isl, a.osl, None))
                    cpu1 = {p.name.split()[-1]: proc_cpu_s(p.popen.pid) for p in st.procs}
                    rec.update({"repeat": rep, "system": s, "concurrency": c, "requests": requests_for(a, c),
                                "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0 if cpu0[k] is not None and cpu1.get(k)
                                          is not None}})
                    runs.append(rec)
                    m = rec["metrics"]
                    log(f"r{rep} {s} c{c}: {m['output_tok_s']:.0f} tok/s, {m['request_per_s']:.1f} req/s, "
                        f"TTFT p50 {m['ttft_p50_ms']:.1f} ms, cpu {rec['cpu_s']}, bad {rec['n_bad']}")
    finally:
        for st in stacks.values():
            st.stop()
    summary = summarize(runs, a.concurrency, list(systems))
    table = markdown(summary, runs, list(systems))
    cost = None
    if cost_of is not None:
        cost, cost_table = cpu_cost_table(runs, a.concurrency, (cost_of, next(s for s in systems if s != cost_of)))
        table = f"{table}\n\nCPU per request by process:\n\n{cost_table}"
    print(table)
    out = Path(a.out.replace("frontend_ceiling-", f"frontend_ceiling_{label}-"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": f"turbine_frontend_ceiling_{label}", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": vars(a), "summary": summary, "cpu_cost": cost, "runs": runs, "markdown": table},
        indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0 if all(r["ok"] for r in runs) else 1


def build_parser() -> argparse.ArgumentParser:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--aiperf", default=default_aiperf(),
                   help="aiperf executable (env AIPERF; default: make bench-tools' .bench-venv/bin/aiperf, else PATH)")
    p.add_argument("--python", default=sys.executable, help="Turbine's python")
    p.add_argument("--dynamo-python", default=default_dynamo_python(),
                   help="python of the venv with ai-dynamo 1.6.1 (env DYNAMO_PYTHON; default: make bench-peer's "
                        ".peer-venv/bin/python)")
    p.add_argument("--peer-dir", default=env("TURBINE_PEER_DIR", str(DEFAULT_PEER_DIR)),
                   help="folder with the peer's zmq_broker.py; env TURBINE_PEER_DIR; default shared/peer in or beside the checkout")
    p.add_argument("--turbine-baseline", default=env("TURBINE_BASELINE"),
                   help="another Turbine checkout, measured as system turbine-base with this venv's python; env TURBINE_BASELINE")
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32])
    p.add_argument("--isl", type=int, default=200)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=300,
                   help="measured requests = max(this, --requests-multiplier × C); the peer's bench.sh used 100 / 10")
    p.add_argument("--requests-multiplier", type=int, default=40)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--order", choices=("abab", "abba"), default="abba")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, in order, of {', '.join(SYSTEMS)}; the first is the ratios' numerator "
                        "(default turbine,dynamo, or turbine,turbine-base,dynamo with --turbine-baseline)")
    p.add_argument("--dynamo-speedup", default="1000")
    p.add_argument("--turbine-mocker-args", default="")
    p.add_argument("--dynamo-mocker-args", default="")
    p.add_argument("--py-spy", default=env("PY_SPY"), help="py-spy executable: profile Turbine's frontend afterwards; env PY_SPY")
    p.add_argument("--py-spy-seconds", type=int, default=30)
    p.add_argument("--py-spy-concurrency", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--point-timeout", type=float, default=300)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--tools", action="store_true",
                   help="measure tool-call parsing instead: turbine-tools (every answer a hermes tool call, parsed) "
                        "vs turbine (the same answer as plain content), one mocker stack, built-in load (no aiperf); "
                        "--isl is then the prompt's word count")
    p.add_argument("--cluster-key", action="store_true",
                   help="measure the cluster key instead: turbine-key (frontend and mocker share TURBINE_CLUSTER_KEY: "
                        "request-plane handshake, signed events) vs turbine (no key), two stacks up side by side, "
                        "KV router, built-in load (no aiperf); --isl is then the prompt's word count")
    p.add_argument("--responses", action="store_true",
                   help="measure the Responses API instead: turbine-responses (streamed, stored: every response "
                        "saved before its last event) vs turbine (streamed chat completions), one mocker stack, "
                        "built-in load (no aiperf); --isl is then the prompt's word count; the store's time per "
                        "operation from the frontend's /metrics")
    p.add_argument("--response-store", choices=("memory", "nats"), default="memory",
                   help="with --responses: the frontend's --response-store")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                   help="with --responses --response-store nats: a NATS server with JetStream")
    p.add_argument("--request-planes", action="store_true",
                   help="measure the NATS request plane instead: turbine-nats (frontend and mocker on "
                        "--request-plane nats, through a private nats-server) vs turbine (tcp), two stacks up side "
                        "by side, built-in load (no aiperf); reports CPU per request of every process")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "frontend" / f"frontend_ceiling-{today}.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.tools:
        return run_tools(a, parser)
    if a.responses:
        return run_responses(a)
    if a.cluster_key:
        return run_cluster_key(a)
    if a.request_planes:
        return run_request_planes(a)
    if a.systems is None:
        a.systems = "turbine,turbine-base,dynamo" if a.turbine_baseline else "turbine,dynamo"
    systems = [s for s in a.systems.split(",") if s]
    if bad := [s for s in systems if s not in SYSTEMS] or (len(set(systems)) != len(systems) and ["(repeated)"]):
        parser.error(f"--systems: unknown or repeated {bad}; choose from {', '.join(SYSTEMS)}")
    if not a.aiperf:
        parser.error("--aiperf: no aiperf found (env AIPERF, .bench-venv/bin/aiperf, PATH): run `make bench-tools`")
    if "dynamo" in systems and not a.dynamo_python:
        parser.error("system dynamo needs --dynamo-python (or env DYNAMO_PYTHON)")
    if "dynamo" in systems and not (Path(a.peer_dir) / "zmq_broker.py").is_file():
        parser.error(f"system dynamo needs zmq_broker.py in --peer-dir ({a.peer_dir})")
    if "turbine-base" in systems and not a.turbine_baseline:
        parser.error("system turbine-base needs --turbine-baseline PATH (or env TURBINE_BASELINE)")
    origins = {}
    for s in systems:  # which checkout each Turbine system really imports, before spending time on it
        if s.startswith("turbine"):
            origins[s] = turbine_origin(a.python, system_env(a, s))
            log(f"{s}: turbine from {origins[s]['root']} ({origins[s]['commit']})")
    if "turbine-base" in systems:
        want = str(Path(a.turbine_baseline).resolve())
        if origins["turbine-base"]["root"] != want:
            parser.error(f"turbine-base imports turbine from {origins['turbine-base']['root']}, not {want}: "
                         f"{origins['turbine-base']['error'] or ''}")
    a.model = a.model or default_model(a.python)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-frontend-ceiling-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"logs under {run_dir}")
    runs: list[dict] = []
    failures = 0
    started = time.time()
    starters = {"turbine": start_turbine_stack, "dynamo": start_dynamo_stack,
                "turbine-base": lambda a_, d, t: start_turbine_stack(a_, d, t, "turbine-base")}
    try:
        for rep in range(a.repeats):
            order = systems if (a.order == "abab" or rep % 2 == 0) else list(reversed(systems))
            for s in order:
                tag = f"r{rep}_{s}"
                wait_quiet()
                log(f"repeat {rep + 1}/{a.repeats}: starting {s}")
                st = None
                try:
                    st = starters[s](a, run_dir, tag)
                    for c in a.concurrency:
                        wait_quiet()
                        rec = run_point(a, st, c, rep, run_dir)
                        runs.append(rec)
                        failures += not rec["ok"]
                        if st.any_dead():
                            raise RuntimeError(f"{tag}: a process died:\n{st.logs_tail()}")
                except RuntimeError as e:
                    failures += 1
                    log(f"{tag}: {e}")
                finally:
                    if st is not None:
                        st.stop()
                    time.sleep(3)
    except KeyboardInterrupt:
        failures += 1
        log("interrupted")
    profile = None
    if a.py_spy:
        try:
            profile = profile_turbine(a, run_dir, out.parent)
        except Exception as e:  # noqa: BLE001 - the profile is extra; keep the measurement
            log(f"py-spy profile failed: {e}")
            profile = {"error": str(e)}
    summary = summarize(runs, a.concurrency, systems)
    table = markdown(summary, runs, systems)
    print(table)
    if profile and profile.get("summary"):
        print("\npy-spy self time (% of samples):")
        for f, pct in profile["summary"]["self_top"]:
            print(f"  {pct:5.1f}  {f}")
    result = {"benchmark": "turbine_frontend_ceiling", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "versions": {"turbine_venv": versions(a.python), "turbine_checkouts": origins,
                           "dynamo_venv": subprocess.run([a.dynamo_python, "-c", "import importlib.metadata as m, json;"
                                                          "print(json.dumps({d: m.version(d) for d in ('ai-dynamo', 'ai-dynamo-runtime')}))"],
                                                         capture_output=True, text=True).stdout.strip()
                           if "dynamo" in systems else None,
                           "aiperf": subprocess.run([a.aiperf, "--version"], capture_output=True, text=True,
                                                    timeout=120).stdout.strip()[-40:]},
              "systems": systems, "config": vars(a), "work_dir": str(run_dir), "summary": summary, "runs": runs,
              "py_spy": profile, "markdown": table}
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

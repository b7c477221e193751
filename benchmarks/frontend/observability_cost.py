#!/usr/bin/env python3
r"""The frontend's CPU per request with issue #21's observability against the code before it.

One process per measurement: the frontend's ASGI app (driven in-process through httpx's ASGI
transport, as tests/unit/frontend/http/test_frontend_http.py does) in front of a real request-plane
server that answers every streamed chat request with --tokens one-token chunks (the worker is in
the same process: its CPU is in every system's number alike). The process's CPU time for
--requests requests (after a warmup) / requests = CPU per request. Systems:

  base        another checkout (--baseline PATH, env TURBINE_BASELINE: before issue #21), same venv
  default     this tree as shipped: access log on (to a JSON handler writing to /dev/null), tracing off
  no-access   this tree, --no-access-log: what the request-id wrapper alone costs
  tracing     this tree, access log on, tracing on: BatchSpanProcessor into an exporter that drops
              the spans (the SDK's work per span, without a network)

The systems alternate (ABBA over --repeats); reported: medians of the per-repeat ratios to base,
and (one more run each, under cProfile) the Python function calls per request, which do not depend on
what else the host runs.

  .venv/bin/python -m benchmarks.frontend.observability_cost --baseline /tmp/turbine-base --repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Standalone (its child runs this file by path against another checkout): the checkout is two folders up.
REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("base", "default", "no-access", "tracing")


def child(system: str, requests: int, tokens: int, count_calls: bool = False) -> None:
    """One measurement in this process; prints {"cpu_per_request_ms": ...}."""
    import asyncio
    import logging

    import httpx

    from tests.unit.frontend.dispatch.test_dispatch import instance, served
    from turbine.frontend.app import Frontend, FrontendConfig
    from turbine.frontend.http.api import asgi_app
    from turbine.frontend.models.tokenizer import TextTokenizer
    from turbine.model.prepare import prepare
    from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
    from turbine.runtime.request_plane import RequestPlaneServer

    if system != "base":
        from turbine.logging_setup import JsonFormatter

        handler = logging.StreamHandler(open(os.devnull, "w"))
        handler.setFormatter(JsonFormatter())
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # the load generator's own line per request
    if system == "tracing":
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        from turbine import tracing

        class Drop(SpanExporter):
            def export(self, spans):
                return SpanExportResult.SUCCESS

        tracing.install(BatchSpanProcessor(Drop()), "bench")

    tokenizer = TextTokenizer.from_dir(prepare())
    token = tokenizer.encode(" the", add_special_tokens=False)

    async def generate(req: GenerateRequest, ctx):
        for i in range(tokens):
            last = i == tokens - 1
            yield GenerateOutput(token_ids=token, finish_reason="length" if last else None,
                                 usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=tokens) if last
                                 else None)

    async def main() -> float:
        server = RequestPlaneServer()
        server.register("generate", GenerateRequest, generate)
        await server.start()
        kwargs = {} if system == "base" else {"access_log": system != "no-access"}
        frontend = Frontend(FrontendConfig(**kwargs))
        frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about rivers."}], "stream": True,
                "max_tokens": tokens}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://f") as http:
            for _ in range(50):  # warmup
                (await http.post("/v1/chat/completions", json=body)).raise_for_status()
            profile = None
            if count_calls:
                import cProfile

                profile = cProfile.Profile()
                profile.enable()
            start = time.process_time()
            for _ in range(requests):
                resp = await http.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
            cpu = time.process_time() - start
            if profile is not None:
                import pstats

                profile.disable()
                cpu = pstats.Stats(profile).total_calls  # Python function calls instead
        await frontend.client.close()
        await server.stop()
        return cpu

    cpu = asyncio.run(main())
    if count_calls:
        print(json.dumps({"calls_per_request": cpu / requests}))
    else:
        print(json.dumps({"cpu_per_request_ms": cpu / requests * 1e3}))


def measure(system: str, a, count_calls: bool = False) -> float:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    root = a.baseline if system == "base" else str(REPO_ROOT)
    env["PYTHONPATH"] = str(Path(root).resolve())
    env.pop("TURBINE_LOG_FORMAT", None)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", system, "--requests",
                          str(a.requests), "--tokens", str(a.tokens), *(["--count-calls"] if count_calls else [])],
                         env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{system} failed:\n{out.stderr[-3000:]}")
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    return answer["calls_per_request"] if count_calls else answer["cpu_per_request_ms"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=os.environ.get("TURBINE_BASELINE"),
                   help="a Turbine checkout from before issue #21 (env TURBINE_BASELINE)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=64, help="one-token chunks per streamed answer")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/frontend/observability_cost-DATE.json)")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--count-calls", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.requests, a.tokens, a.count_calls)
        return 0
    if not a.baseline:
        p.error("--baseline (or TURBINE_BASELINE): a checkout from before issue #21")
    runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for rep in range(a.repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            runs[system].append(measure(system, a))
            print(f"repeat {rep}: {system} {runs[system][-1]:.3f} ms CPU/request", flush=True)
    ratios = {s: statistics.median(runs[s][i] / runs["base"][i] for i in range(a.repeats)) for s in SYSTEMS[1:]}
    # Python function calls per request: deterministic, unlike CPU time on a shared host.
    calls = {s: measure(s, a, count_calls=True) for s in SYSTEMS}
    print("calls per request:", json.dumps(calls), flush=True)
    result = {"command": " ".join(sys.argv), "requests": a.requests, "tokens": a.tokens, "repeats": a.repeats,
              "baseline": a.baseline, "cpu_per_request_ms": runs, "median_ratio_to_base": ratios,
              "python_calls_per_request": calls,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(a.out or REPO_ROOT / "benchmarks" / "results" / "frontend" / f"observability_cost-{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

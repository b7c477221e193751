"""The frontend's CPU per request for token-id prompts of several lengths (the GPU serving benchmark's prompts,
`/v1/completions` with `prompt: [ids]`, streamed), this checkout against another (`--baseline PATH`), both frontends
over one simulated worker (the mocker, fast enough that the frontend is what is measured).

Issue #29 §5 found Turbine 0.1–0.4 % under `vllm serve` on prefill-heavy load (1,024-token prompts) at C = 64 / 256
on an H200; a frontend cost that grows with the prompt is paid once per request at each wave's start. Per point and
system: the frontend process's CPU seconds per request (from /proc) and the client's TTFT p50 / p99. Systems alternate
their order per repeat; the ratios are this checkout's over the baseline's, medians over repeats.

    git worktree add /tmp/turbine-base <rev>
    .venv/bin/python -m benchmarks.frontend.token_prompt_cpu --baseline /tmp/turbine-base --repeats 3 \\
        --out benchmarks/results/frontend/token_prompt_cpu-$(date +%F).json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu.gpu_serving import load_point
from benchmarks.lib.args import parse_int_list
from benchmarks.lib.paths import default_model
from benchmarks.lib.proc import exit_on_sigterm, http_post_json, log, proc_cpu_s
from benchmarks.lib.results import dump_json, git_commit
from benchmarks.lib.stack import Stack
from benchmarks.lib.stats import median
from turbine.runtime.ports import free_port

SERVED = "m"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="another Turbine checkout: the peer's frontend")
    p.add_argument("--model", default=os.environ.get("TURBINE_BENCH_MODEL"),
                   help="model folder for the tokenizer (env TURBINE_BENCH_MODEL; default: turbine model prepare)")
    p.add_argument("--isl", type=parse_int_list, default=[128, 1024, 4096], help="prompt lengths, comma separated")
    p.add_argument("--osl", type=int, default=4, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=640, help="requests per point")
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    exit_on_sigterm()
    model = a.model or default_model(sys.executable)
    run_dir = Path(tempfile.mkdtemp(prefix="token-prompt-cpu-"))
    env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", TURBINE_DISCOVERY_DIR=str(run_dir / "discovery"))
    stack = Stack("token-prompt-cpu", run_dir, "stack")
    try:
        stack.spawn("mocker", [sys.executable, "-m", "turbine.mocker", "--model", model, "--served-model-name",
                               SERVED, "--speedup-ratio", "1000", "--max-num-seqs", "1024",
                               "--max-num-batched-tokens", "1000000", "--num-gpu-blocks", "1000000"], env)
        frontends = {}
        for system, checkout in (("turbine", None), ("baseline", a.baseline.resolve())):
            port = free_port()
            # The baseline's code only: PYTHONSAFEPATH keeps this checkout (the working directory) off its path.
            fe_env = env if checkout is None else dict(env, PYTHONPATH=str(checkout), PYTHONSAFEPATH="1")
            proc = stack.spawn(f"frontend-{system}", [sys.executable, "-m", "turbine.frontend", "--http-port",
                                                      str(port), "--no-access-log"], fe_env)
            frontends[system] = (f"http://127.0.0.1:{port}", proc)
        for system, (url, _) in frontends.items():
            # Ready once a completion goes through (the model in /health came before its worker was routable),
            # a few of them warming each frontend up before its first point.
            stack.wait_ready(lambda: http_post_json(f"{url}/v1/completions", {"model": SERVED, "prompt": [1, 2, 3],
                                                                           "max_tokens": 1})[0] == 200, 120)
            load_point(url, SERVED, max(a.isl), a.osl, a.concurrency, a.concurrency, a.client_processes, "warm-up")
        points = []
        for rep in range(a.repeats):
            order = list(frontends) if rep % 2 == 0 else list(frontends)[::-1]
            for isl in a.isl:
                for system in order:
                    url, proc = frontends[system]
                    before = proc_cpu_s(proc.popen.pid)
                    r = load_point(url, SERVED, isl, a.osl, a.concurrency, a.requests, a.client_processes,
                                   f"{rep}:{isl}:{system}")
                    cpu_ms = (proc_cpu_s(proc.popen.pid) - before) * 1000 / a.requests
                    points.append({"repeat": rep, "system": system, "isl": isl, "frontend_cpu_ms_per_request":
                                   round(cpu_ms, 4), "ttft_p50_ms": r["ttft_p50_ms"], "ttft_p99_ms": r["ttft_p99_ms"],
                                   "ok": r["ok"], "errors": r["errors"]})
                    log(f"r{rep} {system} isl={isl}: frontend {cpu_ms:.3f} ms CPU/request, TTFT p50 "
                        f"{r['ttft_p50_ms']} p99 {r['ttft_p99_ms']} ms, {r['ok']} ok")
        summary = {}
        for isl in a.isl:
            med = {s: {k: median([q[k] for q in points if q["system"] == s and q["isl"] == isl])
                       for k in ("frontend_cpu_ms_per_request", "ttft_p50_ms", "ttft_p99_ms")} for s in frontends}
            summary[isl] = {**med, "cpu_ratio": round(med["turbine"]["frontend_cpu_ms_per_request"]
                                                      / med["baseline"]["frontend_cpu_ms_per_request"], 3)}
            print(f"isl {isl}: frontend CPU/request {med['turbine']['frontend_cpu_ms_per_request']:.3f} vs "
                  f"{med['baseline']['frontend_cpu_ms_per_request']:.3f} ms ({summary[isl]['cpu_ratio']}x); "
                  f"TTFT p99 {med['turbine']['ttft_p99_ms']} vs {med['baseline']['ttft_p99_ms']} ms")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(dump_json({"benchmark": "token_prompt_cpu", "commit": git_commit(),
                                    "baseline": str(a.baseline), "args": {k: str(v) for k, v in vars(a).items()},
                                    "cpus": os.cpu_count(), "points": points, "summary": summary}))
        log(f"wrote {a.out}")
        return 0
    finally:
        for proc in reversed(stack.procs):
            proc.stop(15)


if __name__ == "__main__":
    sys.exit(main())

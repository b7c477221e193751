#!/usr/bin/env python3
r"""Frontend CPU micro-benchmark: the per-token and per-request tokenizer work of one streamed
request, in one process, one thread at a time.

detok    IncrementalDetokenizer over a generated answer pushed one token at a time (what the
         frontend does per token), then flush: this tree's (tokenizers' DecodeStream: one call
         into Rust per token) against the one of --compare-ref (default b979bab: two Python
         `decode` calls per token), loaded from git as a private module.  Workloads: `english`
         (64-token answers of plain English, the ceiling benchmark's case) and `multibyte`
         (CJK / emoji text whose tokens split characters).  Each stream has a chat prompt's last
         tokens as context, as in the frontend.
encode   one ~200-token chat prompt to ids: `encode` on the calling thread, `encode_batch` on
         the calling thread, and both through the event loop's default executor (what
         `TextTokenizer.encode_off_loop` does).  Measured as the process's CPU time (every thread:
         `encode_batch` may wake the library's own thread pool) and wall time per request.
api      (`--api responses`, instead of the two above) one API body through the frontend's request
         stages before dispatch (for `responses`: decode, convert to the chat request, chat template,
         tokenization -- `turbine.frontend.apis.responses.prepare`), in-process against a model
         table holding the tokenizer: process CPU and wall time per request.  Bodies: `short` (a
         string input and instructions) and `agent` (an agent loop's transcript with four tools).
         With --callgrind: instructions per request instead (N requests minus 0, as for detok).

Every timing is a median over --repeats rounds (implementations alternate inside each round),
reported per token (detok) or per request (encode).  On a shared, noisy host prefer the
instruction counts: `--callgrind` runs each detok implementation under valgrind's callgrind
twice (N streams and 0 streams) and reports (Ir(N) - Ir(0)) / tokens, which does not depend on
other load.

  .venv/bin/python -m benchmarks.frontend.frontend_cpu_micro --repeats 15
  .venv/bin/python -m benchmarks.frontend.frontend_cpu_micro --callgrind --streams 50   # instructions/token
  .venv/bin/python -m benchmarks.frontend.frontend_cpu_micro --api responses --repeats 15  # per request
  .venv/bin/python -m benchmarks.frontend.frontend_cpu_micro --api responses --callgrind --encode-calls 50

The model folder comes from --model, else env TURBINE_BENCH_MODEL, else the repo's own resolution
(`turbine model prepare`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Standalone (callgrind runs this file by path in a child): the checkout is two folders up.
REPO_ROOT = Path(__file__).resolve().parents[2]

from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.frontend.postprocess import detokenizer as current_detok

ENGLISH = ("The quick brown fox jumps over the lazy dog while the committee reviews its annual budget, "
           "and the river keeps flowing past the old mill where children once played on summer evenings. ")
MULTIBYTE = "日本語のテキストを分割する。한국어 텍스트도 🙂🙃 café — Ελληνικά! 🧑‍🚀 世界 "


def default_model() -> str:
    if os.environ.get("TURBINE_BENCH_MODEL"):
        return os.environ["TURBINE_BENCH_MODEL"]
    from turbine.model.prepare import resolve  # noqa: PLC0415 - only when needed
    return resolve(None)  # the embedded default model, prepared once into the cache


def legacy_detok_class(ref: str):
    # the detokenizer's path at that revision: postprocess/ since the frontend's folders (issue #32), top level before
    for rel in ("turbine/frontend/postprocess/detokenizer.py", "turbine/frontend/detokenizer.py"):
        got = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{ref}:{rel}"], capture_output=True, text=True)
        if got.returncode == 0:
            break
    else:
        raise SystemExit(f"--compare-ref {ref}: no detokenizer at {ref} ({got.stderr.strip()})")
    src = got.stdout.replace("turbine.frontend.tokenizer import", "turbine.frontend.models.tokenizer import")
    path = Path(tempfile.mkdtemp(prefix="detok_ref_")) / "detokenizer_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("detokenizer_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.IncrementalDetokenizer


def answers(tok: TextTokenizer, text: str, n: int, length: int) -> list[list[int]]:
    ids = tok.encode(text * 40, add_special_tokens=False)
    step = max(1, (len(ids) - length) // max(1, n))
    return [ids[(i * step) % (len(ids) - length):][:length] for i in range(n)]


def run_streams(cls, tok, prompt, outs, stop) -> int:
    n = 0
    for out in outs:
        d = cls(tok, prompt, stop)
        for t in out:
            d.push([t])
        d.flush()
        n += len(out)
    return n


def check_equal(cls_a, cls_b, tok, prompt, outs, stop) -> None:
    for out in outs:
        texts = []
        for cls in (cls_a, cls_b):
            d = cls(tok, prompt, stop)
            texts.append([d.push([t]) for t in out] + [d.flush()])
        if texts[0] != texts[1]:
            raise SystemExit(f"implementations disagree on {out[:10]}...: {texts[0][:8]} vs {texts[1][:8]}")


def bench_detok(a, tok, impls: dict) -> dict:
    prompt = tok.encode_chat([{"role": "user", "content": ENGLISH}])
    res = {}
    for wl, text in (("english", ENGLISH), ("multibyte", MULTIBYTE)):
        outs = answers(tok, text, a.streams, a.osl)
        for stop in ([], ["\n\n"]):
            check_equal(*impls.values(), tok, prompt, outs, stop)
            key = f"{wl}{'+stop' if stop else ''}"
            samples = {name: [] for name in impls}
            for rep in range(a.repeats):
                order = list(impls.items()) if rep % 2 == 0 else list(reversed(impls.items()))
                for name, cls in order:
                    t0 = time.thread_time_ns()
                    n = run_streams(cls, tok, prompt, outs, stop)
                    samples[name].append((time.thread_time_ns() - t0) / n)
            row = {name: {"ns_per_token_median": statistics.median(v), "min": min(v), "max": max(v)}
                   for name, v in samples.items()}
            names = list(impls)
            row["ratio"] = row[names[1]]["ns_per_token_median"] / row[names[0]]["ns_per_token_median"]
            res[key] = row
            print(f"detok {key:16s} " + "  ".join(f"{n}: {row[n]['ns_per_token_median']:7.0f} ns/token"
                                                  for n in names) + f"  ratio {names[1]}/{names[0]} {row['ratio']:.2f}",
                  file=sys.stderr)
    return res


def bench_encode(a, tok) -> dict:
    raw = tok._tokenizer  # noqa: SLF001 - the benchmark compares the library's calls directly
    text = tok.apply_chat_template([{"role": "user", "content": (ENGLISH * 3)[:900]}])
    n_tokens = len(tok.encode(text, add_special_tokens=False))

    async def via_executor(fn, n):
        loop = asyncio.get_running_loop()
        for _ in range(n):
            await loop.run_in_executor(None, fn)

    variants = {
        "encode (loop thread)": lambda n: [raw.encode(text, add_special_tokens=False) for _ in range(n)],
        "encode_batch (loop thread)": lambda n: [raw.encode_batch([text], add_special_tokens=False) for _ in range(n)],
        "executor + encode_batch (encode_off_loop)": lambda n: asyncio.run(
            via_executor(lambda: raw.encode_batch([text], add_special_tokens=False), n)),
        "executor + encode": lambda n: asyncio.run(via_executor(lambda: raw.encode(text, add_special_tokens=False), n)),
    }
    samples = {k: {"cpu": [], "wall": []} for k in variants}
    n = a.encode_calls
    for rep in range(a.repeats):
        items = list(variants.items())
        for name, fn in (items if rep % 2 == 0 else reversed(items)):
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            fn(n)
            c1, w1 = time.process_time_ns(), time.perf_counter_ns()
            samples[name]["cpu"].append((c1 - c0) / n / 1000)
            samples[name]["wall"].append((w1 - w0) / n / 1000)
    res = {"prompt_tokens": n_tokens}
    for name, s in samples.items():
        res[name] = {"cpu_us_median": statistics.median(s["cpu"]), "wall_us_median": statistics.median(s["wall"])}
        print(f"encode {n_tokens} tokens, {name:42s} process CPU {res[name]['cpu_us_median']:7.1f} us, "
              f"wall {res[name]['wall_us_median']:7.1f} us", file=sys.stderr)
    return res


def _tool(name: str) -> dict:
    return {"type": "function", "name": name, "description": f"Looks up the {name} of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "units": {
                "type": "string", "enum": ["metric", "imperial"]}}, "required": ["city"]}}


# Responses bodies, as a client sends them (store false: no response store in this process).
RESPONSES_BODIES = {
    "short": {"model": "m", "instructions": "Answer in one sentence.", "input": ENGLISH[:200],
              "max_output_tokens": 64, "temperature": 0.7, "store": False},
    "agent": {"model": "m", "instructions": "Use the tools when they help.", "store": False, "tool_choice": "auto",
              "tools": [_tool(n) for n in ("weather", "time", "population", "elevation")],
              "input": [
                  {"role": "user", "content": [{"type": "input_text", "text": "Weather and time in Paris?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                   "content": [{"type": "reasoning_text", "text": "Two tools answer this."}]},
                  {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
                  {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
                   "arguments": '{"city": "Paris"}', "status": "completed"},
                  {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "time",
                   "arguments": '{"city": "Paris"}', "status": "completed"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
                  {"type": "function_call_output", "call_id": "call_2", "output": "14:05"}]},
}


def api_runner(a, tok):
    """run(body, n): n requests of one API's body through its request stages before dispatch."""
    from turbine.frontend.apis import responses  # noqa: PLC0415
    from turbine.frontend.models.table import ModelTable, ServedModel  # noqa: PLC0415
    from turbine.router.policy import RoundRobinRouter  # noqa: PLC0415
    from turbine.protocol.discovery import ModelCard  # noqa: PLC0415

    card = ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id="x",
                     tokenizer_path=a.model, context_length=8192, kv_block_size=16, total_kv_blocks=1024,
                     max_num_seqs=64, max_num_batched_tokens=8192, tool_call_parser="hermes")
    models = ModelTable(None, None)
    models.models["m"] = ServedModel("m", card, tok, RoundRobinRouter(), [object()])  # one (unused) instance

    async def requests(body: bytes, n: int) -> None:
        for _ in range(n):
            await responses.prepare(body, models)

    return lambda body, n: asyncio.run(requests(body, n))


def bench_api(a, tok) -> dict:
    """Per-request CPU of one API's request stages before dispatch (see the module docstring)."""
    import msgspec  # noqa: PLC0415

    run = api_runner(a, tok)
    res = {}
    n = a.encode_calls
    for name, body in RESPONSES_BODIES.items():
        raw = msgspec.json.encode(body)
        run(raw, 20)  # warm: template compiled, executor threads started
        cpu, wall = [], []
        for _ in range(a.repeats):
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            run(raw, n)
            cpu.append((time.process_time_ns() - c0) / n / 1000)
            wall.append((time.perf_counter_ns() - w0) / n / 1000)
        res[name] = {"body_bytes": len(raw), "cpu_us_median": statistics.median(cpu), "cpu_us_min": min(cpu),
                     "cpu_us_max": max(cpu), "wall_us_median": statistics.median(wall)}
        print(f"api {a.api} {name:6s} ({len(raw)} bytes) process CPU {res[name]['cpu_us_median']:7.1f} us/request "
              f"(min {min(cpu):.1f}, max {max(cpu):.1f}), wall {res[name]['wall_us_median']:7.1f} us", file=sys.stderr)
    return res


def callgrind_api(a) -> dict:
    """Instructions per request of each body: callgrind totals with N requests minus with 0 (both
    after the same 20 warm-up requests), divided by N. The child imports this checkout's turbine."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = {}
    for body in RESPONSES_BODIES:
        irs = {}
        for n in (a.encode_calls, 0):
            with tempfile.TemporaryDirectory() as d:
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/cg.out", sys.executable, __file__,
                       "--model", a.model, "--api", a.api, "--only-api-body", body, "--encode-calls", str(n)]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
                if not m:
                    raise SystemExit(f"callgrind failed: {r.stderr[-2000:]}")
                irs[n] = int(m.group(1))
        out[body] = {"instructions_per_request": (irs[a.encode_calls] - irs[0]) / a.encode_calls, "ir": irs}
        print(f"callgrind api {a.api} {body}: {out[body]['instructions_per_request']:.0f} instructions/request "
              f"({a.encode_calls} requests)", file=sys.stderr)
    return out


def callgrind(a) -> dict:
    """Instructions per token of each detok implementation: callgrind totals with N streams
    minus with 0 streams (startup, imports, tokenizer load), divided by the tokens pushed."""
    out = {}
    for impl in ("ref", "current"):
        irs = {}
        for streams in (a.streams, 0):
            with tempfile.TemporaryDirectory() as d:
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/cg.out", sys.executable, __file__,
                       "--model", a.model, "--compare-ref", a.compare_ref, "--only-detok", impl,
                       "--streams", str(streams), "--osl", str(a.osl)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
                if not m:
                    raise SystemExit(f"callgrind failed: {r.stderr[-2000:]}")
                irs[streams] = int(m.group(1))
        tokens = a.streams * a.osl
        out[impl] = {"instructions_per_token": (irs[a.streams] - irs[0]) / tokens, "ir": irs, "tokens": tokens}
        print(f"callgrind {impl}: {out[impl]['instructions_per_token']:.0f} instructions/token "
              f"({a.streams} english streams of {a.osl} tokens, one token per push, no stop strings)", file=sys.stderr)
    out["ratio"] = out["current"]["instructions_per_token"] / out["ref"]["instructions_per_token"]
    return out


def main(argv: list[str] | None = None) -> int:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (env TURBINE_BENCH_MODEL; default: turbine model prepare)")
    p.add_argument("--compare-ref", default="b979bab", help="git revision whose detokenizer is the reference")
    p.add_argument("--streams", type=int, default=200, help="answers per round")
    p.add_argument("--osl", type=int, default=64, help="tokens per answer")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--encode-calls", type=int, default=500, help="encode calls (with --api: requests) per round")
    p.add_argument("--callgrind", action="store_true",
                   help="instruction counts of the detok implementations (with --api: per request) instead")
    p.add_argument("--api", choices=("responses",),
                   help="per-request CPU of this API's request stages (instead of detok and encode)")
    p.add_argument("--only-api-body", choices=tuple(RESPONSES_BODIES), help=argparse.SUPPRESS)
    p.add_argument("--only-detok", choices=("ref", "current"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/frontend/"
                   "frontend_cpu_micro[_API]-DATE.json)")
    a = p.parse_args(argv)
    name = f"frontend_cpu_micro{'_' + a.api if a.api else ''}-{today}.json"
    a.out = a.out or str(REPO_ROOT / "benchmarks" / "results" / "frontend" / name)
    a.model = a.model or default_model()
    tok = TextTokenizer.from_dir(a.model)
    if a.only_api_body:  # one plain run, for callgrind
        run = api_runner(a, tok)
        body = __import__("msgspec").json.encode(RESPONSES_BODIES[a.only_api_body])
        run(body, 20)
        run(body, a.encode_calls)
        return 0
    if a.only_detok:  # one plain run, for callgrind
        cls = legacy_detok_class(a.compare_ref) if a.only_detok == "ref" else current_detok.IncrementalDetokenizer
        prompt = tok.encode_chat([{"role": "user", "content": ENGLISH}])
        run_streams(cls, tok, prompt, answers(tok, ENGLISH, max(1, a.streams), a.osl)[:a.streams], [])
        return 0
    result = {"benchmark": "frontend_cpu_micro", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": [sys.executable, *sys.argv], "model": a.model,
              "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "versions": {"tokenizers": __import__("tokenizers").__version__}, "config": vars(a)}
    if a.api:
        result["api"] = {a.api: callgrind_api(a) if a.callgrind else bench_api(a, tok)}
    elif a.callgrind:
        result["callgrind"] = callgrind(a)
    else:
        impls = {f"ref {a.compare_ref}": legacy_detok_class(a.compare_ref),
                 "current": current_detok.IncrementalDetokenizer}
        result["detok"] = bench_detok(a, tok, impls)
        result["encode"] = bench_encode(a, tok)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

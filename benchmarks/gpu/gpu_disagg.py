#!/usr/bin/env python3
r"""Disaggregated prefill/decode between two GPUs of one host (issue #20, section 3).

  parity   Greedy text of the same chats through one aggregated worker (GPU 0) and through a prefill
           worker (GPU 0) + decode worker (GPU 1) with `--connector nixl` (KV moved GPU to GPU by
           NIXL), the frontend at `--max-local-prefill-length 0` so every prompt is prefilled
           remotely. Requests go one at a time (batch composition changes the numerics). Meant for a
           real model in float32 (the embedded SmolLM2, converted on the host from its GGUF).
  load     A mixed long/short open-loop load (Poisson arrivals, fixed seed, the same schedule for
           both): two aggregated workers (one per GPU, round-robin) against 1 prefill + 1 decode
           worker (the frontend's default --max-local-prefill-length: short prompts are prefilled on
           the decode worker, long ones on the prefill worker). TTFT p50/p99 of short and long
           requests, ITL, output tok/s. Setups in the order given (alternate it between calls).

Every process is Turbine's own (`python -m turbine.frontend`, `python -m turbine.vllm`) on file
discovery; each worker gets one GPU through CUDA_VISIBLE_DEVICES. It also runs on a CPU host (vLLM's
CPU build, NIXL over host memory) for a quick check of the script itself.

    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_disagg parity --model <smollm2 folder> --dtype float32 \
        --out $OUT/gpu_disagg_parity.json
    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_disagg load --model <llama-3.1-8b folder> --load-format dummy \
        --setups disagg,agg --out $OUT/gpu_disagg_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.gpu.gpu_serving import Procs, _ms, free_port, log, machine, pct, stream_completion
from benchmarks.lib.proc import exit_on_sigterm


SERVED = "model"

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "Explain in two sentences why the sky is blue.",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning, my friend' into Spanish and German.",
]
LONG_PARAGRAPH = ("The history of computing is a long story of people building machines that calculate, remember "
                  "and communicate. Early mechanical calculators gave way to electronic computers, then to "
                  "transistors, integrated circuits and the networks that connect them today. ")


def chat_prompts(long_repeats: int) -> list[str]:
    """Short chats and one long one (many KV blocks to move)."""
    return CHATS + [LONG_PARAGRAPH * long_repeats + "Summarise the text above in one sentence."]


def get_json(url: str, timeout: float = 5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except Exception:
        return None, None


def post_json(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def scrape(url: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (no parsing beyond that). A failed scrape is logged
    and raises: an empty answer must not read as "no transfers"."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
    except Exception as exc:
        log(f"scrape {url} failed: {type(exc).__name__}: {exc}")
        raise
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, v in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
    return total


class Stack:
    """Turbine workers (one GPU each) + one frontend on private file discovery."""

    def __init__(self, a, run_dir: Path, name: str):
        self.a, self.name = a, name
        self.procs = Procs(run_dir)
        self.env = {"TURBINE_DISCOVERY_BACKEND": "file", "PYTHONUNBUFFERED": "1",
                    "TURBINE_DISCOVERY_DIR": tempfile.mkdtemp(prefix=f"discovery_{name}_", dir=run_dir)}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.worker_ports: dict[str, int] = {}

    def worker(self, name: str, gpu: int, *flags: str) -> None:
        port = free_port()
        self.worker_ports[name] = port
        argv = [sys.executable, "-m", "turbine.vllm", "--model", str(self.a.model), "--served-model-name", SERVED,
                "--max-model-len", str(self.a.max_model_len), "--system-port", str(port),
                *self.a.engine_args.split(), *flags]
        if self.a.load_format:
            argv += ["--load-format", self.a.load_format]
        if self.a.dtype:
            argv += ["--dtype", self.a.dtype]
        self.procs.spawn(name, argv, dict(self.env, CUDA_VISIBLE_DEVICES=str(gpu)))

    def frontend(self, *flags: str) -> None:
        self.procs.spawn("frontend", [sys.executable, "-m", "turbine.frontend", "--http-port", str(self.port),
                                      "--router-mode", "round-robin", *flags], self.env)

    def wait(self, decode: int, prefill: int) -> float:
        def ready():
            status, body = get_json(f"{self.base}/health")
            return (status == 200 and (body.get("models") or {}).get(SERVED) == decode
                    and (body.get("prefill_workers") or {}).get(SERVED, 0) == prefill)
        try:
            took = self.procs.wait(ready, self.a.start_timeout, self.name)
        except BaseException:
            for n, _ in self.procs.procs:
                log(f"--- {n}\n{self.procs.tail(n)}")
            self.procs.stop()
            raise
        log(f"{self.name} ready after {took:.0f}s")
        return took

    def frontend_metrics(self) -> dict[str, float]:
        return scrape(f"{self.base}/metrics")

    def worker_metrics(self, name: str) -> dict[str, float]:
        return scrape(f"http://127.0.0.1:{self.worker_ports[name]}/metrics")

    def stop(self) -> None:
        self.procs.stop()


def start(a, run_dir: Path, setup: str, *, parity: bool) -> tuple[Stack, float]:
    st = Stack(a, run_dir, setup)
    if setup == "agg-tp2":  # one worker over both cards (tensor parallelism 2): what a user compares 1P1D with
        st.worker("agg_tp2", ",".join(str(g) for g in range(a.gpus)), "--tensor-parallel-size", str(a.gpus))
        st.frontend(*a.frontend_args.split())
        return st, st.wait(decode=1, prefill=0)
    if setup == "agg":
        gpus = [0] if parity else list(range(a.agg_workers))
        for g in gpus:
            st.worker(f"agg{g}", g)
        st.frontend(*a.frontend_args.split())
        return st, st.wait(decode=len(gpus), prefill=0)
    st.worker("prefill", 0, "--disaggregation-mode", "prefill", "--connector", "nixl")
    st.worker("decode", 1 if a.gpus > 1 else 0, "--disaggregation-mode", "decode", *decode_connector(a, parity))
    fe = ["--max-local-prefill-length", "0"] if parity else []
    st.frontend(*fe, *a.frontend_args.split())
    return st, st.wait(decode=1, prefill=1)


def decode_connector(a, parity: bool) -> list[str]:
    """The decode worker's connector. Turbine's default load-failure policy on a decode worker is
    `recompute` (a KV pull that fails is computed locally: the request survives), which would make a
    broken transfer invisible to a parity check; with --strict-kv the parity run gives vLLM's own
    --kv-transfer-config with the policy `fail` instead, so a failed pull fails the request."""
    if not a.strict_kv:
        return ["--connector", "nixl"]
    from turbine.vllm.connectors import kv_transfer_config

    cfg = kv_transfer_config(["nixl"], buffer_device=a.kv_buffer_device, decode=True)
    cfg["kv_load_failure_policy"] = "fail"
    return ["--kv-transfer-config", json.dumps(cfg)]


LOG_MARKERS = ("nixl", "ucx", "kv_transfer", "kv transfer", "error", "warning", "failed")


def nixl_series(metrics: dict[str, float]) -> dict[str, float]:
    """Every NIXL series the decode worker's vLLM exports (bytes moved, descriptors, transfer times), summed
    over labels: the release decides which exist."""
    out: dict[str, float] = {}
    for key, v in metrics.items():
        base = key.split("{", 1)[0]
        if "nixl" in base:
            out[base] = out.get(base, 0.0) + v
    return out


def log_lines(st: "Stack", limit: int = 60) -> dict[str, list[str]]:
    """Each process's log lines that mention the KV transfer or a problem (the logs stay on the host)."""
    out = {}
    for name, _ in st.procs.procs:
        path = st.procs.run_dir / f"{name}.log"
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if any(m in ln.lower() for m in LOG_MARKERS)]
        out[name] = lines[-limit:]
    return out


# --------------------------------------------------------------------------- parity
def run_parity(a, run_dir: Path, doc: dict) -> None:
    prompts = chat_prompts(a.long_repeats)
    for setup in a.setups.split(","):
        st, took = start(a, run_dir, setup, parity=True)
        try:
            before = st.frontend_metrics()
            answers = []
            for p in prompts:
                try:
                    r = post_json(f"{st.base}/v1/chat/completions",
                                  {"model": SERVED, "messages": [{"role": "user", "content": p}],
                                   "max_tokens": a.max_tokens, "temperature": 0.0})
                except urllib.error.HTTPError as exc:  # a failed request is a result (strict KV: a failed pull)
                    answers.append({"text": None, "error": f"HTTP {exc.code}: {exc.read()[:300]!r}",
                                    "usage": {"completion_tokens": None, "prompt_tokens": None}})
                    continue
                answers.append({"text": r["choices"][0]["message"]["content"], "usage": r["usage"],
                                "finish_reason": r["choices"][0]["finish_reason"]})
            after = st.frontend_metrics()
            res = {"start_s": round(took, 1), "answers": answers,
                   "prefills": {w: metric_sum(after, "turbine_frontend_prefills_total", where=w)
                                - metric_sum(before, "turbine_frontend_prefills_total", where=w)
                                for w in ("remote", "local", "local_fallback")}}
            if setup == "disagg":
                wm = st.worker_metrics("decode")
                res["decode_worker_prompt_tokens_by_source"] = {
                    k: v for k, v in wm.items() if k.startswith("vllm:prompt_tokens_by_source_total")
                    or k.startswith("vllm:prompt_tokens_cached_by_source_total")}
                res["decode_worker_nixl"] = {k: v for k, v in wm.items() if "nixl" in k.lower()
                                             and ("_count" in k or "_sum" in k or "_total" in k)}
                res["kv_transferred_tokens"] = metric_sum(wm, "vllm:prompt_tokens_by_source_total",
                                                          source="external_kv_transfer")
                res["nixl_transfers"] = metric_sum(wm, "vllm:nixl_xfer_time_seconds_count")
                res["nixl_failed_transfers"] = metric_sum(wm, "vllm:nixl_num_failed_transfers_total")
                res["strict_kv"] = a.strict_kv
            res["logs"] = log_lines(st)
            doc["setups"][setup] = res
            log(f"{setup}: {[x['usage']['completion_tokens'] for x in answers]} tokens, prefills {res['prefills']}, "
                f"KV tokens pulled {res.get('kv_transferred_tokens')}, NIXL transfers {res.get('nixl_transfers')} "
                f"(failed {res.get('nixl_failed_transfers')})")
        finally:
            st.stop()
    if "agg" in doc["setups"] and "disagg" in doc["setups"]:
        ag, dg = doc["setups"]["agg"]["answers"], doc["setups"]["disagg"]["answers"]
        same = [x["text"] is not None and x["text"] == y["text"] for x, y in zip(ag, dg)]
        doc["identical"] = f"{sum(same)}/{len(same)}"
        doc["prompt_tokens"] = [x["usage"]["prompt_tokens"] for x in ag]
        log(f"disaggregated text identical to aggregated: {doc['identical']}")


# --------------------------------------------------------------------------- load
def schedule(a) -> list[dict]:
    rng = random.Random(a.seed)
    t, out = 0.0, []
    while t < a.duration:
        t += rng.expovariate(a.rate)
        kind = "short" if rng.random() < a.short_frac else "long"
        isl, osl = (a.short_in, a.short_out) if kind == "short" else (a.long_in, a.long_out)
        out.append({"at": t, "kind": kind, "isl": isl, "osl": osl,
                    "prompt": [rng.randrange(100, 49000) for _ in range(isl)]})
    return out


async def _drive(base: str, plan: list[dict]) -> list[dict]:
    import aiohttp

    recs: list[dict] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=conn) as session:
        async def one(item):
            rec = await stream_completion(session, f"{base}/v1/completions", SERVED, item["prompt"], item["osl"])
            rec["kind"] = item["kind"]
            rec.setdefault("end", time.perf_counter())
            recs.append(rec)

        t_start = time.perf_counter()
        tasks = []
        for item in plan:
            delay = t_start + item["at"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)
    return recs


def summarize(recs: list[dict]) -> dict:
    ok = [r for r in recs if "error" not in r]
    span = max(r["end"] for r in ok) - min(r["t0"] for r in ok) if ok else 0.0
    out = {"requests": len(recs), "errors": len(recs) - len(ok),
           "first_errors": [r["error"] for r in recs if "error" in r][:3],
           "output_tok_s": round(sum(r["out"] for r in ok) / span, 1) if span else None}
    for kind in ("short", "long"):
        ttft = [r["ttft"] for r in ok if r["kind"] == kind]
        out[f"{kind}_ttft_p50_ms"], out[f"{kind}_ttft_p99_ms"] = _ms(pct(ttft, 0.5)), _ms(pct(ttft, 0.99))
    itl = [x for r in ok for x in r["itl"]]
    out["itl_p50_ms"], out["itl_p99_ms"] = _ms(pct(itl, 0.5)), _ms(pct(itl, 0.99))
    out["itl_max_ms"] = _ms(max(itl)) if itl else None
    return out


def run_load(a, run_dir: Path, doc: dict) -> None:
    plan = schedule(a)
    warm = [dict(x, at=i * 0.05) for i, x in enumerate(schedule(argparse.Namespace(**{**vars(a), "seed": a.seed + 1,
                                                                                         "duration": 2.0})))]
    doc["plan"] = {"requests": len(plan), "short": sum(x["kind"] == "short" for x in plan)}
    for setup in a.setups.split(","):
        st, took = start(a, run_dir, setup, parity=False)
        try:
            asyncio.run(_drive(st.base, warm))
            before = st.frontend_metrics()
            recs = asyncio.run(_drive(st.base, plan))
            after = st.frontend_metrics()
            res = summarize(recs)
            res["start_s"] = round(took, 1)
            if setup == "disagg":
                wm = st.worker_metrics("decode")
                res["kv_transferred_tokens"] = metric_sum(wm, "vllm:prompt_tokens_by_source_total",
                                                          source="external_kv_transfer")
                res["decode_local_compute_tokens"] = metric_sum(wm, "vllm:prompt_tokens_by_source_total",
                                                                source="local_compute")
                res["nixl_transfers"] = metric_sum(wm, "vllm:nixl_xfer_time_seconds_count")
                res["nixl_failed_transfers"] = metric_sum(wm, "vllm:nixl_num_failed_transfers_total")
                res["nixl_series"] = nixl_series(wm)
                res["strict_kv"] = a.strict_kv
                res["logs"] = log_lines(st)
            res["prefills"] = {w: metric_sum(after, "turbine_frontend_prefills_total", where=w)
                               - metric_sum(before, "turbine_frontend_prefills_total", where=w)
                               for w in ("remote", "local", "local_fallback")}
            doc["setups"].setdefault(setup, []).append(res)
            log(f"{setup}: {json.dumps({k: v for k, v in res.items() if k != 'logs'})}")
        finally:
            st.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("parity", "load"):
        s = sub.add_parser(name)
        s.add_argument("--model", type=Path, required=True)
        s.add_argument("--setups", default="agg,disagg",
                       help="agg, disagg and/or agg-tp2 (load: one worker at tensor parallelism --gpus), in this order")
        s.add_argument("--strict-kv", action=argparse.BooleanOptionalAction, default=True,
                       help="a decode worker's failed KV pull fails the request (vLLM's kv_load_failure_policy "
                            "fail) instead of Turbine's default recompute: a broken transfer cannot hide")
        s.add_argument("--kv-buffer-device", default="cuda", help="where the KV buffer lives (cpu on a CPU host)")
        s.add_argument("--dtype", default=None, help="the workers' --dtype (parity: float32)")
        s.add_argument("--load-format", default=None, help="the workers' --load-format (dummy: random weights)")
        s.add_argument("--max-model-len", type=int, default=4096)
        s.add_argument("--engine-args", default="", help="more worker flags, space separated")
        s.add_argument("--frontend-args", default="", help="more frontend flags, space separated")
        s.add_argument("--gpus", type=int, default=2)
        s.add_argument("--start-timeout", type=float, default=500)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / f"gpu_disagg_{name}.json")
    par = sub.choices["parity"]
    par.add_argument("--max-tokens", type=int, default=64)
    par.add_argument("--long-repeats", type=int, default=30, help="the long chat's paragraph count (~45 tokens each)")
    ld = sub.choices["load"]
    ld.add_argument("--agg-workers", type=int, default=2)
    ld.add_argument("--rate", type=float, default=16.0, help="requests/s")
    ld.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ld.add_argument("--short-frac", type=float, default=0.8)
    ld.add_argument("--short-in", type=int, default=128)
    ld.add_argument("--short-out", type=int, default=256)
    ld.add_argument("--long-in", type=int, default=3072)
    ld.add_argument("--long-out", type=int, default=64)
    a = p.parse_args(argv)
    exit_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_disagg_"))
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "setups": {}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        (run_parity if a.cmd == "parity" else run_load)(a, run_dir, doc)
    finally:
        a.out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {a.out} (logs in {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

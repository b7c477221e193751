#!/usr/bin/env python3
r"""Adapter-aware routing on a simulated LoRA fleet (issue #16): the KV router with its LoRA-slot term
(`aware`) vs the same router without it (`kv`: --router-lora-swap-weight 0) vs `round-robin`.

Each run starts, on a private file-discovery folder (benchmarks/lib/stack.py):
  python -m turbine.mocker --num-workers 4 --enable-lora --max-loras 2 --lora-modules lora00=DIR ... lora15=DIR
        --profile benchmarks/results/mocker/mocker_profile-2026-11-25.json --speedup-ratio 1 --block-size 128
        --num-gpu-blocks 728 --max-num-seqs 128 --max-num-batched-tokens 2048 --max-model-len 2048 --system-port P
  python -m turbine.frontend --router-mode MODE [--router-lora-swap-weight W] --http-port Q
so every worker holds all 16 adapters and can serve any of them; what limits it is its 2 active slots
(a step holds requests of at most 2 distinct adapters, others wait; each swap costs
--lora-load-time-ms, the mocker's default, 0, unless given: a swap cost the real vLLM CPU worker
nothing measurable). The adapters are one real PEFT adapter for
the embedded SmolLM2 (made with peft) under 16 names (the mocker checks adapters, it has no weights).

Load: open loop, Poisson arrivals at --rate requests/s for --duration s; each request names an adapter
drawn from a Zipf law (exponent --zipf over the 16, the same ranking every run), a prompt of random
token ids (--isl tokens; no two prompts share a prefix, so prefix caching plays no part and plain KV
routing is load balancing) through /v1/completions, streamed, --osl output tokens (ignore_eos). The
same seed gives every mode the same requests at the same times.

Reported per mode (medians over --repeats; modes alternate, the order reversed on every other repeat):
TTFT p50/p99 (send to first text), adapter swaps per minute (the mocker's turbine_mocker_lora_swaps
over the load's wall time), output tokens/s, requests per worker, and each mode's ratio to `aware`.

  .venv/bin/python -m benchmarks.routing.lora_routing_fleet --repeats 3 \
      --out benchmarks/results/routing/lora_routing_fleet-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.load import drive, stream_request
from benchmarks.lib.metrics import scrape, worker_spread
from benchmarks.lib.paths import REPO_ROOT, default_model
from benchmarks.lib.proc import http_get_json, http_post_json, log
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.stack import Stack, turbine_env
from benchmarks.lib.stats import fmt, median, pct, ratio
from turbine.runtime.ports import free_port



SERVED = "smollm2-135m-instruct"
MODES = ("aware", "kv", "round-robin")


# --------------------------------------------------------------------------- adapters and load
def build_adapters(model_dir: str, out: Path, n: int) -> list[tuple[str, Path]]:
    """One real PEFT LoRA adapter for the model (rank 8, attention and MLP-down modules), under n names."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    first = out / "lora00"
    if not (first / "adapter_config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                            init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM")
        get_peft_model(model, config).save_pretrained(str(first))
    names = []
    for i in range(n):
        folder = out / f"lora{i:02d}"
        if not folder.exists():
            shutil.copytree(first, folder)
        names.append((folder.name, folder))
    return names


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


class LoraWorkload:
    """The same timed requests for every mode: (send offset, adapter, prompt token ids)."""

    kind = "trace"  # completions, as kv_routing_fleet's stream_request reads them

    def __init__(self, adapters: list[str], a):
        rng = random.Random(a.seed)
        weights = zipf_weights(len(adapters), a.zipf)
        self.items, t = [], 0.0
        while True:
            t += rng.expovariate(a.rate)
            if t >= a.duration:
                break
            adapter = rng.choices(adapters, weights)[0]
            isl = max(1, int(a.isl * rng.uniform(0.75, 1.25)))
            self.items.append((t, adapter, [rng.randrange(1000, 40000) for _ in range(isl)]))
        self.osl = a.osl
        self.mix = {name: sum(1 for _, ad, _ in self.items if ad == name) for name in adapters}

    async def run(self, client, url: str, records: list[dict], t0: float) -> None:
        async def one(offset: float, adapter: str, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            body = {"model": adapter, "prompt": prompt, "max_tokens": self.osl, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            rec = await stream_request(client, f"{url}/v1/completions", body, "trace")
            rec.update(adapter=adapter, offset=offset)
            rec.pop("text", None)
            records.append(rec)

        await asyncio.gather(*(one(*item) for item in self.items))


# --------------------------------------------------------------------------- one run
def mode_flags(mode: str) -> list[str]:
    """`aware` (kv, default weight), `aware-wX` (kv, --router-lora-swap-weight X), `kv` (weight 0), `round-robin`."""
    m = re.fullmatch(r"aware-w([0-9.]+)", mode)
    if m:
        return ["--router-mode", "kv", "--router-lora-swap-weight", m.group(1)]
    return {"aware": ["--router-mode", "kv"], "kv": ["--router-mode", "kv", "--router-lora-swap-weight", "0"],
            "round-robin": ["--router-mode", "round-robin"]}[mode]


def start_stack(a, mode: str, adapters: list[tuple[str, Path]], run_dir: Path, tag: str) -> Stack:
    st = Stack(mode, run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    st.metrics_ports = [free_port()]
    st.argv_mocker = ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED,
                      "--num-workers", str(a.num_workers), "--speedup-ratio", str(a.speedup), "--profile", a.profile,
                      "--block-size", "128", "--num-gpu-blocks", "728", "--max-num-seqs", str(a.max_num_seqs),
                      "--max-num-batched-tokens", "2048", "--max-model-len", "2048",
                      "--system-port", str(st.metrics_ports[0]), "--enable-lora", "--max-loras", str(a.max_loras),
                      *(["--lora-load-time-ms", str(a.lora_load_time_ms)] if a.lora_load_time_ms is not None else []),
                      "--lora-modules", *(f"{name}={path}" for name, path in adapters), *a.mocker_args.split()]
    st.argv_frontend = ["-m", "turbine.frontend", "--http-port", str(st.port), *mode_flags(mode),
                        *a.frontend_args.split()]
    st.spawn("mocker", [a.python, *st.argv_mocker], turbine_env(disc))
    st.spawn("frontend", [a.python, *st.argv_frontend], turbine_env(disc))
    names = {name for name, _ in adapters}

    def ready():
        status, body = http_get_json(f"{st.base_url}/v1/models")
        listed = {m.get("id") for m in (body or {}).get("data") or []} if status == 200 else set()
        status, health = http_get_json(f"{st.base_url}/health")
        return (names <= listed and status == 200
                and (health.get("models") or {}).get(SERVED) == a.num_workers)
    try:
        st.wait_ready(ready, a.startup_timeout)
        time.sleep(2)  # the kv router connects to each worker's event publisher on the discovery change
        status, body = http_post_json(f"{st.base_url}/v1/completions",
                                      {"model": adapters[0][0], "prompt": [1000, 1001], "max_tokens": 2})
        if status != 200:
            raise RuntimeError(f"{tag}: sanity request got HTTP {status}: {body}")
    except BaseException:
        log(st.logs_tail(15))
        st.stop()
        raise
    return st


def swaps(samples) -> float:
    return sum(v for name, _, v in samples if name == "turbine_mocker_lora_swaps_total")


def run_one(a, mode: str, workload: LoraWorkload, adapters, rep: int, run_dir: Path) -> dict:
    tag = f"r{rep}_{mode}"
    wait_quiet()
    st = start_stack(a, mode, adapters, run_dir, tag)
    try:
        url = f"http://127.0.0.1:{st.metrics_ports[0]}/metrics"
        swaps0 = swaps(scrape(url))
        w0 = time.monotonic()
        records, t0 = asyncio.run(drive(workload, st.base_url))
        w1 = time.monotonic()
        samples = scrape(url)
        died = [p.name for p in st.procs if not p.alive()]
    finally:
        st.stop()
    ok = [r for r in records if r["error"] is None]
    ttft = [(r["t_first"] - r["t_send"]) * 1e3 for r in ok]
    done = max((r["t_end"] for r in ok), default=w1)
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    wall = w1 - w0
    m = {"repeat": rep, "mode": mode, "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
         "error_samples": [r["error"] for r in records if r["error"]][:5],
         "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
         "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
         "swaps": swaps(samples) - swaps0, "wall_s": wall, "swaps_per_min": (swaps(samples) - swaps0) / wall * 60,
         "output_tok_s": tokens / (done - t0) if done > t0 else None,
         "ttft_p50_by_adapter": {name: pct([(r["t_first"] - r["t_send"]) * 1e3 for r in ok if r["adapter"] == name], 50)
                                 for name in workload.mix},
         "ttft_by_request": sorted((round(r["offset"], 3), r["adapter"], round((r["t_first"] - r["t_send"]) * 1e3, 1))
                                   for r in ok),
         "workers": worker_spread(samples), "died": died, "mocker_argv": st.argv_mocker,
         "frontend_argv": st.argv_frontend, "logs": [str(p.log_path) for p in st.procs]}
    log(f"{tag}: {m['ok']}/{m['requests']} ok, TTFT p50 {fmt(m['ttft_p50_ms'])} p99 {fmt(m['ttft_p99_ms'])} ms, "
        f"{m['swaps']:.0f} swaps ({m['swaps_per_min']:.0f}/min), {fmt(m['output_tok_s'])} tok/s, "
        f"requests per worker {m['workers']['per_worker']}, {wall:.0f}s")
    if died or m["errors"]:
        log(f"{tag}: errors {m['error_samples']} died {died}\n{st.logs_tail(15)}")
    return m


# --------------------------------------------------------------------------- summary
KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "swaps_per_min", "output_tok_s")


def summarize(runs: list[dict], modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {k: median([r[k] for r in mine if r[k] is not None]) for k in KEYS}
        out[mode]["runs"] = len(mine)
        out[mode]["errors"] = sum(r["errors"] for r in mine)
    base = out.get(modes[0])
    for mode in modes:
        out[mode]["vs_first"] = {k: ratio(out[mode][k], base[k]) for k in KEYS} if base else None
    return out


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(summary: dict, runs: list[dict], modes: list[str]) -> str:
    first = modes[0]
    lines = [f"| mode | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | swaps / min | output tok/s | p50 / {first} | "
             f"p99 / {first} | swaps / {first} | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        s = summary[mode]
        v = s["vs_first"] or {}
        lines.append(f"| {mode} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p90_ms'])} | {fmt(s['ttft_p99_ms'])} | "
                     f"{fmt(s['swaps_per_min'])} | "
                     f"{fmt(s['output_tok_s'])} | {fmt_ratio(v.get('ttft_p50_ms'))} | "
                     f"{fmt_ratio(v.get('ttft_p99_ms'))} | {fmt_ratio(v.get('swaps_per_min'))} | {s['runs']} |")
    lines += ["", "| repeat | mode | ok | TTFT p50 | TTFT p90 | TTFT p99 | swaps / min | tok/s | requests per worker |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['repeat']} | {r['mode']} | {r['ok']}/{r['requests']} | {fmt(r['ttft_p50_ms'])} | "
                     f"{fmt(r['ttft_p90_ms'])} | "
                     f"{fmt(r['ttft_p99_ms'])} | {fmt(r['swaps_per_min'])} | {fmt(r['output_tok_s'])} | "
                     f"{r['workers']['per_worker']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help="aware, aware-wX, kv, round-robin")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--lora-load-time-ms", type=float, default=None, help="default: the mocker's")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second over the fleet")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--profile", default=str(REPO_ROOT / "benchmarks/results/mocker/mocker_profile-2026-11-25.json"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--mocker-args", default="")
    ap.add_argument("--frontend-args", default="")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.model = a.model or default_model(a.python)
    modes = a.modes.split(",")
    for mode in modes:
        mode_flags(mode)  # a KeyError names a mode we do not know
    run_dir = Path(a.work_dir or tempfile.mkdtemp(prefix=f"turbine-lora-fleet-{time.strftime('%Y%m%d-%H%M%S')}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    adapters = build_adapters(a.model, run_dir / "adapters", a.adapters)
    workload = LoraWorkload([name for name, _ in adapters], a)
    log(f"{len(workload.items)} requests over {a.duration:.0f}s; adapter mix {workload.mix}; logs in {run_dir}")
    runs = []
    for rep in range(a.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            runs.append(run_one(a, mode, workload, adapters, rep, run_dir))
    summary = summarize(runs, modes)
    table = markdown(summary, runs, modes)
    print(table)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "argv": sys.argv, "config": {k: v for k, v in vars(a).items()}, "adapter_mix": workload.mix,
            "summary": summary, "runs": runs, "table": table}, indent=1, default=str))
    return 1 if any(r["errors"] or r["died"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

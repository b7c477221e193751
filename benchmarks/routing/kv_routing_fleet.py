#!/usr/bin/env python3
r"""KV-aware routing on a simulated fleet (issue #4): `--router-mode kv` vs `round-robin` vs `random`.

Each run starts, on a private file-discovery folder (benchmarks/lib/stack.py):
  python -m turbine.mocker --num-workers 16 --profile benchmarks/results/mocker/mocker_profile-2026-11-25.json
        --speedup-ratio 1 --max-num-seqs 128 --max-num-batched-tokens 2048 --max-model-len 2048
        --block-size B --num-gpu-blocks N --system-port P
  python -m turbine.frontend --router-mode MODE --http-port Q
waits until the frontend lists all 16 instances, sends one sanity request, then drives one
workload from this process (its own asyncio + httpx streaming load generator: aiperf cannot send
multi-turn histories) and stops both.  Every run starts with empty caches.  Modes alternate
(kv, round-robin, random, then reversed on the next repeat); the reported values are medians
over repeats.

Workloads:
  chat   multi-turn chat through /v1/chat/completions: --conversations conversations, each with one
         of --system-prompts shared system prompts (~--system-tokens tokens); --turns turns; each
         turn's prompt is the system prompt + every earlier user message and answer + a new user
         message (~--user-tokens tokens); answers are --answer-tokens tokens (ignore_eos).
         Open loop: conversations start as a Poisson process (--session-rate per second) and each
         turn has its own time, --turn-gap-s (exponential mean) after the previous turn's; a turn
         whose previous answer is not back by then goes out --min-think-s after it (counted late).
         Block size 128 and 728 blocks per worker, like the real vLLM CPU worker
         (VLLM_CPU_KVCACHE_SPACE=2, SmolLM2-135M).
  trace  the Mooncake synthetic trace (--trace; shared/data/mooncake_synthetic_trace.jsonl), the
         requests of one prefix family (first hash id) in --trace-sample, at random (families never
         share prefixes, so the sample keeps the trace's reuse), through /v1/completions with
         token-id prompts.  Each 512-token
         hash id becomes --trace-tokens-per-id tokens (default 16: 32x shorter prompts), the same
         tokens for the same id (drawn from a generator seeded by the id), so equal hash-id prefixes
         are equal token prefixes; a prompt is input_length x 16/512 tokens (its last id partial),
         cut to fit the 2048-token context.  The mocker runs with --trace-block-size (default 16,
         so one hash id = one KV block, as in Mooncake) and the same KV capacity in tokens (5824
         blocks of 16 = 728 x 128).  Output: min(output_length, --trace-max-output) tokens,
         ignore_eos.  Arrivals: the trace's timestamps divided by --trace-speed.

Reported per workload and mode: TTFT p50/p99 (first non-empty content), ITL p50 (per request:
(last token time - first token time) / (completion tokens - 1), p50 over requests), output
tokens/s (completion tokens from usage / time from first send to last answer), cache hit rate =
sum of usage.prompt_tokens_details.cached_tokens / sum of prompt tokens, and the oracle hit rate:
a worker-agnostic prefix cache with unlimited capacity that sees the prompts' blocks in send
order and each chat answer's blocks once it is back (the router's block hashes; like the engines,
at most the full blocks before a prompt's last token count).  The TTFT floor: each request's
prefill alone on a worker holding the oracle's prefix, timed by the profile (no router beats its p50).  Per-worker request counts come from the mocker's /metrics.

  .venv/bin/python -m benchmarks.routing.kv_routing_fleet --repeats 2 \
      --out benchmarks/results/routing/kv_routing_fleet-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.load import drive, stream_request
from benchmarks.lib.metrics import scrape, worker_spread
from benchmarks.lib.paths import REPO_ROOT, default_model, shared_path
from benchmarks.lib.proc import http_get_json, log, proc_cpu_s, tail
from benchmarks.lib.quiet import wait_quiet
from benchmarks.lib.results import dump_json
from benchmarks.lib.stack import Stack, turbine_env
from benchmarks.lib.stats import fmt, median, pct, ratio
from turbine.runtime.ports import free_port



SERVED = "smollm2-135m-instruct"
MODES = ("kv", "round-robin", "random")
WORKLOADS = ("chat", "trace")
# The trace comes from --trace or $TURBINE_BENCH_TRACE; by default the project's shared/ folder in or beside the checkout.
DEFAULT_TRACE = shared_path("data", "mooncake_synthetic_trace.jsonl")
MOONCAKE_BLOCK = 512


# --------------------------------------------------------------------------- workloads
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "fa", "gu", "hi", "jo", "be", "co", "da",
              "el", "fi", "go", "ha", "in", "ju", "ke", "la", "mo", "nu", "or", "pe", "qui", "ra", "su", "ti",
              "ul", "va", "we", "xo", "ya", "zu", "an", "en", "on", "un", "ar", "er", "ir", "ur", "al", "il"]


def words(rng: random.Random, n: int) -> str:
    """n pseudo-words (about 1.5-2 tokens each for SmolLM2's tokenizer)."""
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


class ChatWorkload:
    kind = "chat"

    def __init__(self, a, tokenizer):
        self.a = a
        self.tok = tokenizer
        rng = random.Random(a.seed)
        # Sizes are in words; calibrated to tokens below (pseudo-words tokenize to ~1.7 tokens).
        per_word = self._tokens_per_word(rng)
        self.systems = [f"You are assistant number {i}. " + words(rng, int(a.system_tokens / per_word))
                        for i in range(a.system_prompts)]
        self.sessions = []
        t = 0.0
        for c in range(a.conversations):
            t += rng.expovariate(a.session_rate) if c else 0.0
            gaps = [0.0] + [rng.expovariate(1 / a.turn_gap_s) for _ in range(a.turns - 1)]
            self.sessions.append({
                "id": c, "start": t, "system": rng.randrange(a.system_prompts),
                "users": [f"Question {k + 1} of conversation {c}: " + words(rng, int(a.user_tokens / per_word))
                          for k in range(a.turns)],
                "at": [t + sum(gaps[:k + 1]) for k in range(a.turns)]})
        self.requests_total = a.conversations * a.turns

    def _tokens_per_word(self, rng: random.Random) -> float:
        sample = words(random.Random(rng.random()), 2000)
        return len(self.tok.encode(sample, add_special_tokens=False)) / 2000

    def describe(self) -> dict:
        span = max(s["at"][-1] for s in self.sessions)
        return {"conversations": self.a.conversations, "turns": self.a.turns, "system_prompts": self.a.system_prompts,
                "system_tokens": [len(self.tok.encode(s, add_special_tokens=False)) for s in self.systems],
                "user_tokens_target": self.a.user_tokens, "answer_tokens": self.a.answer_tokens,
                "session_rate_per_s": self.a.session_rate, "turn_gap_s_mean": self.a.turn_gap_s,
                "min_think_s": self.a.min_think_s, "schedule_span_s": span,
                "offered_req_per_s": self.requests_total / span if span else None}

    async def run(self, client, url: str, records: list[dict], t0: float) -> None:
        a = self.a

        async def session(s):
            messages = [{"role": "system", "content": self.systems[s["system"]]}]
            answered = None
            for k, user in enumerate(s["users"]):
                # Open loop: each turn has its time; a turn whose previous answer is not back by then
                # goes out as soon as it is (plus --min-think-s), and counts as late.
                due = t0 + s["at"][k]
                ready = answered + a.min_think_s if answered is not None else due
                await asyncio.sleep(max(0.0, max(due, ready) - time.monotonic()))
                messages.append({"role": "user", "content": user})
                prompt_ids = self.tok.encode_chat(messages)
                if len(prompt_ids) + a.answer_tokens > a.max_model_len:
                    break  # the history no longer fits: the conversation ends
                body = {"model": SERVED, "messages": messages, "max_tokens": a.answer_tokens, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                rec = await stream_request(client, f"{url}/v1/chat/completions", body, "chat")
                rec.update({"session": s["id"], "turn": k, "prompt_ids": prompt_ids, "late_s": rec["t_send"] - due})
                records.append(rec)
                if rec["error"]:
                    break
                answered = time.monotonic()
                messages.append({"role": "assistant", "content": rec.pop("text")})

        await asyncio.gather(*(session(s) for s in self.sessions))


class TraceWorkload:
    kind = "trace"

    def __init__(self, a, vocab: int):
        self.a = a
        self.path = Path(a.trace)
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        # A sample of whole prefix families (requests whose first hash id is the same share their
        # prefixes; different first ids never do), so the sample keeps the trace's reuse.
        rows = [r for r in rows if random.Random(r["hash_ids"][0] * 7919 + a.seed).random() < 1 / a.trace_sample]
        if a.trace_requests:
            rows = rows[:a.trace_requests]
        self.families = len({r["hash_ids"][0] for r in rows})
        tpi = a.trace_tokens_per_id
        id_tokens: dict[int, list[int]] = {}
        self.items = []
        self.truncated = 0
        t_first = rows[0]["timestamp"]
        for r in rows:
            max_tokens = max(1, min(r["output_length"], a.trace_max_output))
            n = math.ceil(r["input_length"] * tpi / MOONCAKE_BLOCK)
            limit = a.max_model_len - max_tokens - 1
            if n > limit:
                n = limit
                self.truncated += 1
            ids: list[int] = []
            for h in r["hash_ids"]:
                if len(ids) >= n:
                    break
                block = id_tokens.get(h)
                if block is None:
                    g = random.Random(a.seed * 1_000_003 + h)
                    block = id_tokens[h] = [g.randrange(1000, vocab) for _ in range(tpi)]
                ids += block
            ids = ids[:n]
            self.items.append({"at": (r["timestamp"] - t_first) / 1000 / a.trace_speed, "prompt_ids": ids,
                               "max_tokens": max_tokens})
        self.requests_total = len(self.items)

    def describe(self) -> dict:
        a = self.a
        lens = [len(i["prompt_ids"]) for i in self.items]
        outs = [i["max_tokens"] for i in self.items]
        span = self.items[-1]["at"] if self.items else 0
        return {"trace": str(self.path), "requests": len(self.items), "sample": f"1/{a.trace_sample} of prefix families",
                "families": self.families,
                "tokens_per_hash_id": a.trace_tokens_per_id, "scale": f"512 -> {a.trace_tokens_per_id} tokens per id",
                "speed": a.trace_speed, "replay_span_s": span, "offered_req_per_s": len(lens) / span if span else None,
                "prompt_tokens_p50": pct(lens, 50), "prompt_tokens_p90": pct(lens, 90), "prompt_tokens_mean": statistics.fmean(lens),
                "truncated_to_context": self.truncated, "max_output": a.trace_max_output,
                "output_tokens_mean": statistics.fmean(outs)}

    async def run(self, client, url: str, records: list[dict], t0: float) -> None:
        async def one(i, item):
            await asyncio.sleep(max(0.0, t0 + item["at"] - time.monotonic()))
            body = {"model": SERVED, "prompt": item["prompt_ids"], "max_tokens": item["max_tokens"], "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            rec = await stream_request(client, f"{url}/v1/completions", body, "completions")
            rec.pop("text", None)
            rec.update({"index": i, "prompt_ids": item["prompt_ids"], "late_s": rec["t_send"] - (t0 + item["at"])})
            records.append(rec)

        await asyncio.gather(*(one(i, item) for i, item in enumerate(self.items)))


# --------------------------------------------------------------------------- oracle + metrics
def oracle_cached(records: list[dict], block_size: int) -> list[int]:
    """Cached tokens of each request (in `records` order) under a worker-agnostic prefix cache of
    unlimited capacity, fed with every prompt's blocks when it is sent and, when a chat answer
    comes back, with the blocks the engine computed while decoding it (prompt + answer, as the
    conversation's next prompt spells them: the mocker's answers encode back to their tokens)."""
    from turbine.router.hashing import block_hashes
    by_turn = {(r["session"], r["turn"]): r for r in records if "turn" in r}
    events = []  # (time, order, kind, record index)
    for i, r in enumerate(records):
        events.append((r["t_send"], 0, "prompt", i))
        nxt = by_turn.get((r.get("session"), r.get("turn", -2) + 1))
        if nxt is not None and r.get("t_end") is not None:
            events.append((r["t_end"], 1, "answer", i))
    seen: set[int] = set()
    out = [0] * len(records)
    for _, _, kind, i in sorted(events):
        r = records[i]
        if kind == "answer":
            # The answer's last token is sampled but never computed: it has no KV yet.
            computed = len(r["prompt_ids"]) + r["completion_tokens"] - 1
            seen.update(block_hashes(by_turn[(r["session"], r["turn"] + 1)]["prompt_ids"][:computed], block_size))
            continue
        ids = r["prompt_ids"]
        hashes = block_hashes(ids, block_size)
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        out[i] = min(n, (len(ids) - 1) // block_size) * block_size
        seen.update(hashes)
    return out


def lone_prefill_ms(profile, prompt_tokens: int, cached_tokens: int) -> float:
    """The mocker's time for this prompt's prefill alone in a step (no other work, no queue)."""
    from turbine.mocker.timing import attention_pairs
    new = prompt_tokens - cached_tokens
    return profile.step_ms(new, attention_pairs(new, cached_tokens), 0, 0)


def analyze(records: list[dict], block_size: int, profile=None) -> dict:
    """`profile` (the mocker's TimingProfile): also the TTFT floor, each request's prefill alone
    on a worker holding the oracle's cached prefix: no router can beat its p50 on this workload,
    which bounds the TTFT ratio against round-robin."""
    ok = [r for r in records if r["error"] is None]
    oracle = oracle_cached(ok, block_size)
    ttft = [(r["t_first"] - r["t_send"]) * 1e3 for r in ok]
    floor = [lone_prefill_ms(profile, r["prompt_tokens"], o) for r, o in zip(ok, oracle)] if profile else []
    own = [lone_prefill_ms(profile, r["prompt_tokens"], r["cached_tokens"]) for r in ok] if profile else []
    itl = [(r["t_last"] - r["t_first"]) * 1e3 / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    out_tokens = sum(r["completion_tokens"] for r in ok)
    t0 = min((r["t_send"] for r in records), default=0)
    t1 = max((r["t_end"] for r in ok), default=t0)
    mismatch = sum(1 for r in ok if r["prompt_tokens"] != len(r["prompt_ids"]))
    # Where the hits were lost: requests that got less than the oracle, by how much.
    short = [o - r["cached_tokens"] for r, o in zip(ok, oracle) if r["cached_tokens"] < o]
    by_turn = {}
    for r, o in zip(ok, oracle):
        if "turn" in r:
            t = by_turn.setdefault(r["turn"], [0, 0, 0, 0.0])
            t[0] += r["prompt_tokens"]
            t[1] += r["cached_tokens"]
            t[2] += o
            t[3] += (r["t_first"] - r["t_send"]) * 1e3
    per_turn = {k: {"requests": None, "hit_rate": v[1] / v[0], "oracle_hit_rate": v[2] / v[0]}
                for k, v in sorted(by_turn.items())}
    for k in per_turn:
        n = sum(1 for r in ok if r.get("turn") == k)
        per_turn[k]["requests"] = n
        per_turn[k]["ttft_mean_ms"] = by_turn[k][3] / n
    compact = [[round(r["t_send"] - t0, 3), round((r["t_first"] - r["t_send"]) * 1e3, 1), r["prompt_tokens"],
                r["cached_tokens"], o, r.get("session", r.get("index")), r.get("turn")] for r, o in zip(ok, oracle)]
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "error_samples": sorted({r["error"] for r in records if r["error"]})[:5],
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_floor_p50_ms": pct(floor, 50), "lone_prefill_p50_ms": pct(own, 50),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "output_tok_s": out_tokens / (t1 - t0) if t1 > t0 else None, "makespan_s": t1 - t0,
        "request_per_s": len(ok) / (t1 - t0) if t1 > t0 else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out_tokens,
        "hit_rate": cached / prompt if prompt else None,
        "oracle_hit_rate": sum(oracle) / prompt if prompt else None,
        "hit_over_oracle": (cached / sum(oracle)) if sum(oracle) else None,
        "prompt_token_count_mismatches": mismatch,
        "loadgen_late_s_p99": pct([r.get("late_s") for r in records if r.get("late_s") is not None], 99),
        "requests_below_oracle": len(short), "tokens_below_oracle": sum(short),
        "tokens_above_oracle": sum(r["cached_tokens"] - o for r, o in zip(ok, oracle) if r["cached_tokens"] > o),
        "per_turn": per_turn,
        "request_table_columns": ["t_send_s", "ttft_ms", "prompt_tokens", "cached_tokens", "oracle_cached_tokens",
                                  "session_or_index", "turn"],
        "request_table": compact,
    }


# --------------------------------------------------------------------------- stacks
def mocker_argv(a, workload: str, port: int) -> list[str]:
    if workload == "chat":
        bs, blocks = a.chat_block_size, a.num_gpu_blocks
    else:
        bs = a.trace_block_size
        blocks = a.trace_num_gpu_blocks or a.num_gpu_blocks * a.chat_block_size // bs
    return ["-m", "turbine.mocker", "--model", a.model, "--served-model-name", SERVED, "--num-workers", str(a.num_workers),
            "--speedup-ratio", str(a.speedup), "--profile", a.profile, "--block-size", str(bs), "--num-gpu-blocks", str(blocks),
            "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--max-model-len", str(a.max_model_len), "--system-port", str(port), *a.mocker_args.split()]


def mode_flags(mode: str) -> list[str]:
    """`kv`, `round-robin`, `random`, or `kv-wX`: kv with --router-kv-overlap-score-weight X."""
    m = re.fullmatch(r"kv-w([0-9.]+)", mode)
    if m:
        return ["--router-mode", "kv", "--router-kv-overlap-score-weight", m.group(1)]
    return ["--router-mode", mode]


def vllm_argv(a, port: int) -> list[str]:
    return ["-m", "turbine.vllm", "--model", a.model, "--served-model-name", SERVED, "--enforce-eager",
            "--max-model-len", str(a.max_model_len), "--system-port", str(port), *a.vllm_args.split()]


def start_stack(a, mode: str, workload: str, run_dir: Path, tag: str) -> Stack:
    st = Stack(mode, run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    st.argv_frontend = ["-m", "turbine.frontend", "--http-port", str(st.port), *mode_flags(mode),
                        *a.frontend_args.split()]
    if a.engine == "mocker":
        st.metrics_ports = [free_port()]
        st.argv_mocker = mocker_argv(a, workload, st.metrics_ports[0])
        st.spawn("mocker", [a.python, *st.argv_mocker], turbine_env(disc))
    else:  # real vLLM CPU workers, each computing on its own core
        st.metrics_ports = [free_port() for _ in range(a.num_workers)]
        st.argv_mocker = vllm_argv(a, 0)
        for i, port in enumerate(st.metrics_ports):
            st.spawn(f"worker{i}", [a.python, *vllm_argv(a, port)],
                     turbine_env(disc, VLLM_CPU_KVCACHE_SPACE="2",
                                 VLLM_CPU_OMP_THREADS_BIND=str(i % (os.cpu_count() or 1))))
    st.spawn("frontend", [a.python, *st.argv_frontend], turbine_env(disc))

    def ready():
        status, body = http_get_json(f"{st.base_url}/health")
        return status == 200 and isinstance(body, dict) and (body.get("models") or {}).get(SERVED) == a.num_workers
    try:
        st.wait_ready(ready, a.startup_timeout)
        time.sleep(2)  # the kv router connects to each worker's event publisher on the discovery change
        st.sanity_check(SERVED)
    except BaseException:
        log(st.logs_tail(15))
        st.stop()
        raise
    return st


def run_one(a, mode: str, workload, rep: int, run_dir: Path) -> dict:
    tag = f"r{rep}_{workload.kind}_{mode}"
    wait_quiet()
    st = start_stack(a, mode, workload.kind, run_dir, tag)
    try:
        procs = {p.name.split()[-1]: p.popen.pid for p in st.procs}
        cpu0 = {k: proc_cpu_s(pid) for k, pid in procs.items()}
        self0, w0 = time.process_time(), time.monotonic()
        records, _ = asyncio.run(drive(workload, st.base_url))
        w1 = time.monotonic()
        cpu1 = {k: proc_cpu_s(pid) for k, pid in procs.items()}
        cpu_self = time.process_time() - self0
        mocker_metrics = [m for port in st.metrics_ports for m in scrape(f"http://127.0.0.1:{port}/metrics")]
        frontend_metrics = scrape(f"{st.base_url}/metrics")
        died = [p.name for p in st.procs if not p.alive()]
    finally:
        st.stop()
    bs = a.chat_block_size if workload.kind == "chat" else a.trace_block_size
    from turbine.mocker.timing import load_profile
    m = analyze(records, bs, load_profile(a.profile))
    log(f"{tag}: {m['requests_below_oracle']} requests below the oracle by {m['tokens_below_oracle']} tokens in all; "
        f"per turn hit/oracle: " + ", ".join(f"{k}: {v['hit_rate']:.2f}/{v['oracle_hit_rate']:.2f}"
                                              for k, v in m["per_turn"].items()))
    m.update({"repeat": rep, "mode": mode, "workload": workload.kind, "wall_s": w1 - w0, "block_size": bs,
              "cpu_util": {k: (cpu1[k] - cpu0[k]) / (w1 - w0) if cpu0.get(k) is not None and cpu1.get(k) is not None
                           else None for k in procs} | {"loadgen": cpu_self / (w1 - w0)},
              "workers": worker_spread(mocker_metrics),
              "router_metrics": {f"{n}{json.dumps(l, sort_keys=True) if l else ''}": v for n, l, v in frontend_metrics
                                 if "router" in n and not n.endswith(("_bucket", "_created"))},
              "died": died, "mocker_argv": st.argv_mocker, "frontend_argv": st.argv_frontend,
              "logs": [str(p.log_path) for p in st.procs]})
    log(f"{tag}: {m['ok']}/{m['requests']} ok, TTFT p50 {fmt(m['ttft_p50_ms'])} p99 {fmt(m['ttft_p99_ms'])} ms, "
        f"ITL p50 {fmt(m['itl_p50_ms'])} ms, {fmt(m['output_tok_s'])} tok/s, hit {fmt((m['hit_rate'] or 0) * 100)} % "
        f"(oracle {fmt((m['oracle_hit_rate'] or 0) * 100)} %), workers min/max {m['workers']['min']}/{m['workers']['max']}, "
        f"cpu {json.dumps({k: round(v, 2) for k, v in m['cpu_util'].items() if v is not None})}, {m['wall_s']:.0f}s")
    if died or m["errors"]:
        log(f"{tag}: errors {m['error_samples']} died {died}")
        for p in st.procs:
            log(f"--- {p.log_path} ---\n{tail(p.log_path, 15)}")
    return m


# --------------------------------------------------------------------------- summary
KEYS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "ttft_floor_p50_ms", "lone_prefill_p50_ms", "itl_p50_ms", "output_tok_s", "request_per_s", "hit_rate",
        "oracle_hit_rate", "hit_over_oracle")


def summarize(runs: list[dict], modes: list[str], workloads: list[str]) -> dict:
    summary = {}
    for w in workloads:
        row = {}
        for mode in modes:
            rs = [r for r in runs if r["workload"] == w and r["mode"] == mode]
            row[mode] = {k: median([r[k] for r in rs]) for k in KEYS}
            row[mode]["runs"] = len(rs)
            row[mode]["errors"] = sum(r["errors"] for r in rs)
            row[mode]["worker_max_over_min"] = median([r["workers"]["max"] / r["workers"]["min"]
                                                       for r in rs if r["workers"].get("min")])
        if "kv" in modes and "round-robin" in modes:
            per = []
            for rep in sorted({r["repeat"] for r in runs}):
                x = {r["mode"]: r for r in runs if r["workload"] == w and r["repeat"] == rep}
                if "kv" in x and "round-robin" in x:
                    per.append(ratio(x["round-robin"]["ttft_p50_ms"], x["kv"]["ttft_p50_ms"]))
            row["ttft_p50_rr_over_kv"] = ratio(row["round-robin"]["ttft_p50_ms"], row["kv"]["ttft_p50_ms"])
            row["ttft_p50_rr_over_kv_per_repeat"] = per
            row["ttft_mean_rr_over_kv"] = ratio(row["round-robin"]["ttft_mean_ms"], row["kv"]["ttft_mean_ms"])
            # The best any router could do: round-robin's measured TTFT over the floor.
            row["ttft_p50_rr_over_floor"] = ratio(row["round-robin"]["ttft_p50_ms"], row["kv"]["ttft_floor_p50_ms"])
        summary[w] = row
    return summary


def markdown(summary: dict, runs: list[dict], modes: list[str], describe: dict) -> str:
    lines = []
    for w, row in summary.items():
        lines += [f"**{w}** ({json.dumps(describe.get(w, {}))})", "",
                  "| mode | TTFT p50 (ms) | TTFT p99 (ms) | lone prefill p50 (ms) | ITL p50 (ms) | output tok/s | req/s | hit rate | oracle hit rate "
                  "| **hit / oracle** | max/min requests per worker | runs |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for mode in modes:
            s = row[mode]
            lines.append(f"| {mode} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p99_ms'])} | {fmt(s['lone_prefill_p50_ms'])} "
                         f"| {fmt(s['itl_p50_ms'])} "
                         f"| {fmt(s['output_tok_s'])} | {fmt(s['request_per_s'], 2)} | {fmt((s['hit_rate'] or 0) * 100)} % "
                         f"| {fmt((s['oracle_hit_rate'] or 0) * 100)} % | **{fmt(s['hit_over_oracle'], 2)}** "
                         f"| {fmt(s['worker_max_over_min'], 2)} | {s['runs']} |")
        if "ttft_p50_rr_over_kv" in row:
            per = ", ".join(fmt(x, 2) for x in row["ttft_p50_rr_over_kv_per_repeat"])
            lines += ["", f"TTFT p50 round-robin / kv: **{fmt(row['ttft_p50_rr_over_kv'], 2)}×** (per repeat: {per}); "
                          f"mean TTFT: {fmt(row['ttft_mean_rr_over_kv'], 2)}×; round-robin over the TTFT floor "
                          f"(a perfect router with no queueing): {fmt(row['ttft_p50_rr_over_floor'], 2)}×"]
        lines.append("")
    lines += ["Every run:", "",
              "| repeat | workload | mode | ok / sent | TTFT p50 / p99 (ms) | ITL p50 (ms) | tok/s | hit / oracle (%) "
              "| requests per worker min / max | CPU frontend / mocker / load-gen (cores) |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cpu = r["cpu_util"]
        lines.append(f"| {r['repeat']} | {r['workload']} | {r['mode']} | {r['ok']} / {r['requests']} "
                     f"| {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'])} | {fmt(r['output_tok_s'])} "
                     f"| {fmt((r['hit_rate'] or 0) * 100)} / {fmt((r['oracle_hit_rate'] or 0) * 100)} "
                     f"| {r['workers']['min']} / {r['workers']['max']} "
                     f"| {fmt(cpu.get('frontend'), 2)} / {fmt(cpu.get('mocker'), 2)} / {fmt(cpu.get('loadgen'), 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    today = _dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--model", default=None, help="model folder (default: `turbine model prepare`)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated: kv, round-robin, random, kv-wX (kv with --router-kv-overlap-score-weight X)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=11)
    g = p.add_argument_group("fleet")
    g.add_argument("--engine", choices=("mocker", "vllm"), default="mocker",
                   help="vllm: --num-workers real vLLM CPU workers (turbine.vllm, --enforce-eager, one core "
                        "each) instead of one mocker process; for the chat workload at a small size")
    g.add_argument("--vllm-args", default="", help="extra turbine.vllm flags (--engine vllm)")
    g.add_argument("--num-workers", type=int, default=16)
    g.add_argument("--speedup", type=float, default=1.0, help="mocker --speedup-ratio")
    g.add_argument("--profile", default=str(REPO_ROOT / "benchmarks/results/mocker/mocker_profile-2026-11-25.json"))
    g.add_argument("--chat-block-size", type=int, default=128, help="the real vLLM CPU worker's block size")
    g.add_argument("--num-gpu-blocks", type=int, default=728, help="blocks of --chat-block-size per worker")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--mocker-args", default="", help="extra turbine mocker flags")
    g.add_argument("--frontend-args", default="", help="extra frontend flags")
    g = p.add_argument_group("chat workload")
    g.add_argument("--conversations", type=int, default=64)
    g.add_argument("--turns", type=int, default=5, help="turns per conversation (5 × ~315 tokens fit 2048)")
    g.add_argument("--system-prompts", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=400)
    g.add_argument("--user-tokens", type=int, default=100)
    g.add_argument("--answer-tokens", type=int, default=200, help="tokens per answer (ignore_eos)")
    g.add_argument("--session-rate", type=float, default=3.0, help="conversations started per second (Poisson)")
    g.add_argument("--turn-gap-s", type=float, default=4.0,
                   help="mean time from one turn's send to the next's (exponential; open loop: the schedule does "
                        "not wait for answers, unless an answer is not back yet)")
    g.add_argument("--min-think-s", type=float, default=0.2, help="a late turn goes out this long after the answer")
    g = p.add_argument_group("trace workload")
    g.add_argument("--trace", default=os.environ.get("TURBINE_BENCH_TRACE", str(DEFAULT_TRACE)),
                   help="the Mooncake synthetic trace (JSONL); env TURBINE_BENCH_TRACE; default: "
                        "shared/data/mooncake_synthetic_trace.jsonl in or beside the checkout")
    g.add_argument("--trace-sample", type=int, default=4,
                   help="keep the requests of one prefix family (first hash id) in this many, at random")
    g.add_argument("--trace-requests", type=int, default=None, help="at most this many (smoke tests)")
    g.add_argument("--trace-tokens-per-id", type=int, default=16, help="tokens per 512-token Mooncake hash id")
    g.add_argument("--trace-block-size", type=int, default=16)
    g.add_argument("--trace-num-gpu-blocks", type=int, default=None,
                   help="default: the chat KV capacity in tokens / --trace-block-size")
    g.add_argument("--trace-speed", type=float, default=16.0, help="replay this many times faster than the trace")
    g.add_argument("--trace-max-output", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=120)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "routing" / f"kv_routing_fleet-{today}.json"))
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    workloads = [w for w in a.workloads.split(",") if w]
    for m in modes:
        if m not in MODES and not re.fullmatch(r"kv-w[0-9.]+", m):
            p.error(f"unknown mode {m} (kv, round-robin, random, or kv-wX for kv with overlap weight X)")
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w}")
    a.model = a.model or default_model(a.python)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(a.work_dir or f"/tmp/turbine-kv-fleet-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    from turbine.frontend.models.tokenizer import TextTokenizer
    tok = TextTokenizer.from_dir(a.model)
    wl = {}
    if "chat" in workloads:
        wl["chat"] = ChatWorkload(a, tok)
    if "trace" in workloads:
        wl["trace"] = TraceWorkload(a, min(tok.vocab_size, 49152))
    describe = {k: w.describe() for k, w in wl.items()}
    log(f"workloads: {json.dumps(describe)}")

    started = time.time()
    runs, failures = [], 0
    for rep in range(a.repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for w in workloads:
            for mode in order:
                try:
                    runs.append(run_one(a, mode, wl[w], rep, run_dir))
                except (RuntimeError, OSError) as e:
                    failures += 1
                    log(f"r{rep} {w} {mode}: FAILED: {e}")
    summary = summarize(runs, modes, workloads)
    table = markdown(summary, runs, modes, describe)
    print(table)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "turbine"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.strip()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_json({"benchmark": "kv_routing_fleet", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                               "duration_s": round(time.time() - started, 1), "command": [sys.executable, *sys.argv],
                               "commit": commit, "turbine_tree_changes": dirty.splitlines(),
                               "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                        "load_avg_end": os.getloadavg()},
                               "config": vars(a), "workloads": describe, "work_dir": str(run_dir), "summary": summary,
                               "runs": runs, "markdown": table}) + "\n")
    log(f"wrote {out} ({time.time() - started:.0f}s)")
    return 1 if failures or any(r["errors"] or r["died"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
r"""Engine parallelism on two GPUs of one host (issue #30, section 2): checks with recorded evidence, on a real
architecture's config with vLLM's dummy weights (the host has no network).

  dp    Data parallelism 2, in the setups given (--setups one,headless):
        one       one worker, --data-parallel-size 2 (a rank per GPU);
        headless  a leader with rank 0 (GPU 0) and a --headless node with rank 1 (GPU 1), on loopback.
        In each: a burst of distinct prompts spreads over both ranks (vLLM's per-rank request counts); a long
        prompt's follow-ups land on the rank that holds its blocks (vLLM's per-rank prefix-cache hits, and
        Turbine's router index of that rank). In `one` also: a second, plain worker joins, streams run, and the
        first worker's rank-1 engine process is killed: every stream completes (migrated).
  moe   A small Mixtral-architecture MoE (written here, dummy weights): one worker with
        --tensor-parallel-size 2 --enable-expert-parallel serves a request; then --data-parallel-size 2
        --enable-expert-parallel (one rank per GPU, experts spread over both) serves one per rank.

Every process is Turbine's own on file discovery; the frontend routes with the KV router. Results and the
checks' verdicts go to --out (JSON); the log says each verdict as it comes.

    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_parallel dp --model <llama-3.1-8b folder> --out $OUT/gpu_dp.json
    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.gpu_parallel moe --tokenizer-from <llama-3.1-8b folder> --out $OUT/gpu_moe.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu.gpu_disagg import SERVED, Stack, get_json, metric_sum, post_json, scrape
from benchmarks.gpu.gpu_serving import free_port, log, machine, stream_completion
from benchmarks.lib.proc import exit_on_sigterm


# A small MoE in Mixtral's published architecture (8 experts, 2 per token), sized to start in seconds.
MIXTRAL_SMALL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
    "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
    "router_aux_loss_coef": 0.02, "output_router_logits": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001,
}


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def complete(base: str, prompt: list[int], max_tokens: int = 4) -> dict:
    return post_json(f"{base}/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0.0, "ignore_eos": True})


def per_rank(metrics: dict[str, float], name: str) -> dict[str, float]:
    """A vLLM series of a worker's /metrics by data-parallel rank (its `engine` label)."""
    out: dict[str, float] = {}
    for key, v in metrics.items():
        if key.split("{", 1)[0] == name and 'engine="' in key:
            engine = key.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + v
    return out


def indexed_by_rank(st: Stack) -> dict[str, float]:
    """The KV router's index by rank (its labels: `<instance>` for rank 0, `<instance>/<rank>` for the others)."""
    out: dict[str, float] = {}
    for key, v in st.frontend_metrics().items():
        if key.startswith("turbine_router_indexed_blocks{") and 'worker="' in key:
            worker = key.split('worker="')[1].split('"')[0]
            rank = worker.rsplit("/", 1)[1] if "/" in worker else "0"  # rank 0 is the bare instance id
            out[rank] = out.get(rank, 0.0) + v
    return out


def wait_for(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.5)
    return False


def check(res: dict, name: str, ok: bool, evidence) -> None:
    res.setdefault("checks", {})[name] = {"ok": bool(ok), "evidence": evidence}
    log(f"{'PASS' if ok else 'FAIL'} {name}: {evidence}")


def burst_and_prefix(a, st: Stack, leader: str, res: dict) -> None:
    rng = random.Random(a.seed)
    before = per_rank(st.worker_metrics(leader), "vllm:request_success_total")

    async def burst():
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*(stream_completion(session, f"{st.base}/v1/completions", SERVED,
                                                            token_prompt(rng, 256), 32) for _ in range(a.burst)))
    recs = asyncio.run(burst())
    after = per_rank(st.worker_metrics(leader), "vllm:request_success_total")
    spread = {r: after.get(r, 0) - before.get(r, 0) for r in ("0", "1")}
    check(res, "burst_spreads_over_both_ranks", all(v > 0 for v in spread.values())
          and not any("error" in r for r in recs), {"served_by_rank": spread,
                                                    "errors": sum("error" in r for r in recs)})

    prefix = token_prompt(rng, 2048)
    s0 = per_rank(st.worker_metrics(leader), "vllm:request_success_total")
    i0 = indexed_by_rank(st)
    complete(st.base, prefix + token_prompt(rng, 16))
    s1 = per_rank(st.worker_metrics(leader), "vllm:request_success_total")
    (rank,) = [r for r in s1 if s1[r] > s0.get(r, 0)]
    indexed = wait_for(lambda: indexed_by_rank(st).get(rank, 0) > i0.get(rank, 0), 20)
    h0 = per_rank(st.worker_metrics(leader), "vllm:prefix_cache_hits_total")
    for _ in range(4):
        complete(st.base, prefix + token_prompt(rng, 16))
    s2 = per_rank(st.worker_metrics(leader), "vllm:request_success_total")
    h1 = per_rank(st.worker_metrics(leader), "vllm:prefix_cache_hits_total")
    hits = {r: h1.get(r, 0) - h0.get(r, 0) for r in ("0", "1")}
    other = "1" if rank == "0" else "0"
    check(res, "long_prefix_follow_ups_land_on_its_rank",
          indexed and s2[rank] - s1[rank] == 4 and hits[rank] >= 4 * 2000 and hits[other] == 0,
          {"rank": rank, "router_indexed_blocks_by_rank": indexed_by_rank(st),
           "follow_ups_served_there": s2[rank] - s1[rank], "prefix_hit_tokens_by_rank": hits})


def engine_core_pids(rank: int) -> list[int]:
    """vLLM names an engine core process after its data-parallel rank (setproctitle)."""
    out = subprocess.run(["pgrep", "-f", f"EngineCore_DP{rank}"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def migration(a, st: Stack, res: dict) -> None:
    """A second (plain) worker joins; streams run; the DP worker's rank-1 engine process is killed."""
    # The model's migration limit comes from its workers' cards: both say 3.
    st.worker("plain", 1, "--gpu-memory-utilization", str(a.plain_gpu_memory_utilization), "--migration-limit", "3")
    st.wait(decode=2, prefill=0)
    pids = engine_core_pids(1)
    rng = random.Random(a.seed + 3)

    async def streams():
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            tasks = [asyncio.create_task(stream_completion(session, f"{st.base}/v1/completions", SERVED,
                                                           token_prompt(rng, 128), a.stream_tokens))
                     for _ in range(16)]
            await asyncio.sleep(a.kill_after)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)
    plain_before = metric_sum(st.worker_metrics("plain"), "vllm:request_success_total")
    recs = asyncio.run(streams())
    dp_exit = dict(st.procs.procs)["dp"].wait(120)
    plain_after = metric_sum(st.worker_metrics("plain"), "vllm:request_success_total")
    fm = st.frontend_metrics()
    migrations = metric_sum(fm, "turbine_frontend_migrations_total")
    ok = [r for r in recs if "error" not in r]
    check(res, "streams_survive_a_killed_rank", len(pids) == 1 and len(ok) == 16 and all(r["out"] == a.stream_tokens for r in ok),
          {"killed_engine_core_pids": pids, "streams_ok": len(ok), "errors": [r["error"] for r in recs if "error" in r][:3],
           "tokens": sorted({r["out"] for r in ok}), "dp_worker_exit": dp_exit,
           "plain_worker_served": plain_after - plain_before, "migrations_metric": migrations})


@contextlib.contextmanager
def one_setup(a, run_dir: Path, doc: dict, name: str):
    """One setup's stack (its logs in a folder of its own) and result record. A failure is recorded with each
    process's log tail and the run goes on with the next setup; the stack is stopped and the JSON written."""
    res: dict = {}
    doc["setups"][name] = res
    (run_dir / name).mkdir()
    st = Stack(a, run_dir / name, name)
    try:
        yield st, res
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        log(f"{name} FAILED: {traceback.format_exc()}")
        for proc, _ in st.procs.procs:
            log(f"--- {proc}\n{st.procs.tail(proc, 25)}")
    finally:
        st.stop()
        a.out.write_text(json.dumps(doc, indent=1))


def run_dp(a, run_dir: Path, doc: dict) -> None:
    dp = ["--data-parallel-size", "2", "--gpu-memory-utilization", str(a.gpu_memory_utilization),
          "--migration-limit", "3"]
    for setup in a.setups.split(","):
        with one_setup(a, run_dir, doc, setup) as (st, res):
            t0 = time.monotonic()
            if setup == "one":
                st.worker("dp", "0,1", *dp)
            elif setup == "headless":
                rpc, kv = str(free_port()), str(free_port())
                multi = ["--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
                         "--data-parallel-rpc-port", rpc, "--kv-events-port", kv]
                st.worker("dp", 0, *dp, *multi)
                node = [sys.executable, "-m", "turbine.vllm", "--headless", "--model", str(a.model),
                        "--served-model-name", SERVED, "--max-model-len", str(a.max_model_len),
                        "--load-format", "dummy", "--data-parallel-size", "2", "--data-parallel-start-rank", "1",
                        "--gpu-memory-utilization", str(a.gpu_memory_utilization), *multi,
                        "--system-port", str(free_port()), *a.engine_args.split(),
                        *(["--dtype", a.dtype] if a.dtype else [])]
                st.procs.spawn("node", node, dict(st.env, CUDA_VISIBLE_DEVICES="1"))
            else:
                raise SystemExit(f"unknown setup {setup!r}")
            st.frontend("--router-mode", "kv")
            st.wait(decode=1, prefill=0)
            res["start_s"] = round(time.monotonic() - t0, 1)
            cards = get_json(f"{st.base}/v1/models")[1]
            res["models"] = cards
            burst_and_prefix(a, st, "dp", res)
            if setup == "one":
                migration(a, st, res)


def write_moe_model(tokenizer_from: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(MIXTRAL_SMALL, indent=1))
    return out


def run_moe(a, run_dir: Path, doc: dict) -> None:
    a.model = write_moe_model(a.tokenizer_from, run_dir / "mixtral-small")
    a.load_format = "dummy"
    shapes = {"tp2_ep": ["--tensor-parallel-size", "2"], "dp2_ep": ["--data-parallel-size", "2"]}
    for name in a.setups.split(","):
        with one_setup(a, run_dir, doc, name) as (st, res):
            st.worker("moe", "0,1", *shapes[name], "--enable-expert-parallel",
                      "--gpu-memory-utilization", "0.3")
            st.frontend("--router-mode", "kv")
            res["start_s"] = round(st.wait(decode=1, prefill=0), 1)
            rng = random.Random(a.seed)
            outs = [complete(st.base, token_prompt(rng, 64), 16) for _ in range(4)]
            by_rank = per_rank(st.worker_metrics("moe"), "vllm:request_success_total")
            text = st.procs.run_dir.joinpath("moe.log").read_text(errors="replace")
            ep = [ln.strip()[:300] for ln in text.splitlines() if "expert" in ln.lower()][:8]
            check(res, f"{name}_serves", all(o["usage"]["completion_tokens"] == 16 for o in outs)
                  and (name != "dp2_ep" or len([r for r, n in by_rank.items() if n > 0]) == 2),
                  {"completion_tokens": [o["usage"]["completion_tokens"] for o in outs], "served_by_rank": by_rank,
                   "expert_log_lines": ep})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dp")
    d.add_argument("--model", type=Path, required=True)
    d.add_argument("--setups", default="one,headless")
    d.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    d.add_argument("--plain-gpu-memory-utilization", type=float, default=0.4)
    d.add_argument("--burst", type=int, default=64, help="distinct requests sent at once")
    d.add_argument("--stream-tokens", type=int, default=512, help="output tokens of each stream the kill cuts")
    d.add_argument("--kill-after", type=float, default=3.0, help="seconds into the streams")
    m = sub.add_parser("moe")
    m.add_argument("--tokenizer-from", type=Path, required=True)
    m.add_argument("--setups", default="tp2_ep,dp2_ep")
    for s in (d, m):
        s.add_argument("--max-model-len", type=int, default=4096)
        s.add_argument("--engine-args", default="", help="more worker flags, space separated")
        s.add_argument("--dtype", default=None)
        s.add_argument("--start-timeout", type=float, default=500)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_parallel.json")
    a = p.parse_args(argv)
    a.load_format = "dummy" if a.cmd == "dp" else None
    exit_on_sigterm()
    run_dir = Path(tempfile.mkdtemp(prefix=f"gpu_parallel_{a.cmd}_"))
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "setups": {}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        (run_dp if a.cmd == "dp" else run_moe)(a, run_dir, doc)
    finally:
        a.out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

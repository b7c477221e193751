"""Sleep / wake of the vLLM engine on a GPU: GPU memory before and after each sleep level, and the
time to sleep and to wake (issue #15, section 3 — the engine half, which vLLM's CPU build cannot show).

The engine is built the way the Turbine vLLM worker builds it: the worker's own command line
(`turbine.vllm.args.parse_worker_args`, so prefix caching, tokenizer and stats settings are the
worker's) and `AsyncLLM.from_engine_args`, with vLLM's `--enable-sleep-mode`; it sleeps and wakes
through the worker's own functions (`turbine.vllm.sleep.sleep_engine` / `wake_engine`). It does not
start the worker host (no discovery, request plane or stat-logger hook): only the engine half.

Sequence: start → memory → greedy generate (reference) → for each level (1, 2), `--cycles` times:
sleep → memory → wake → memory → the worker's canary and the same greedy generate, compared with
the reference token by token; level 2 then restores the weights and generates again.

Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both, and vLLM's
wake_up gives the weights their GPU memory back but not their values (only the model's buffers are
kept), so the first generate after a level-2 wake shows what a worker serves if it does not load its
weights again. With `--load-format dummy` (random weights: the GPU host has no model files) "loading
again" is vLLM's dummy initialiser run in the engine's worker (same seed, so the same weights, so
greedy output must match the reference): its time is not a disk load's. With a real checkpoint the
benchmark calls vLLM's `reload_weights` (from the model folder) instead.

GPU memory is read with NVML (device-wide used bytes and the engine process's bytes) so this process
opens no CUDA context of its own.

    PYTHONPATH=<site>:. python3 -m benchmarks.gpu.sleep_wake_gpu --model <folder> --load-format dummy \\
        --out $OUT/sleep_wake_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time

GIB = 1024**3


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (config.json + tokenizer; weights unless dummy)")
    p.add_argument("--load-format", default="dummy", help="vLLM load format: dummy (random weights) or auto")
    p.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    p.add_argument("--batch", type=int, default=8, help="prompts per check generate")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--engine-args", default="", help="more vLLM flags for the worker's parser, space separated")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="before each level-2 weight reload, drop the OS page cache (root) so weights come from disk")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sleep_wake_gpu.json"))
    return p.parse_args(argv)


class GpuMemory:
    """Device-wide used memory and the bytes of each process, from NVML (no CUDA context here)."""

    def __init__(self):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(self.handle)
        self.name = name.decode() if isinstance(name, bytes) else name
        self.driver = pynvml.nvmlSystemGetDriverVersion()
        self.driver = self.driver.decode() if isinstance(self.driver, bytes) else self.driver

    def read(self) -> dict:
        info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        procs = {}
        try:
            for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                procs[str(proc.pid)] = round((proc.usedGpuMemory or 0) / GIB, 3)
        except self.nvml.NVMLError:
            pass
        return {"used_gib": round(info.used / GIB, 3), "total_gib": round(info.total / GIB, 3),
                "process_gib": procs}


def _build_engine(args: argparse.Namespace):
    from vllm.v1.engine.async_llm import AsyncLLM

    from turbine.vllm.args import parse_worker_args

    argv = ["--model", args.model, "--load-format", args.load_format, "--enable-sleep-mode",
            *args.engine_args.split()]
    cfg = parse_worker_args(argv)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(cfg.engine_args)
    return cfg, engine, time.perf_counter() - t0


async def _generate(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    # Every check generate (the reference too) starts from an empty prefix cache, as after a sleep:
    # a cached prefix takes other kernels, and random weights give near-tied logits that flip on that.
    await engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return outs, time.perf_counter() - t0


def _agreement(outs: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy output against the reference: exact, per-token and first-token agreement. Random weights have
    near-tied logits, so a correct engine can drift late in a sequence; wrong weights disagree from the start."""
    same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o, r))
    total = sum(len(r) for r in reference)
    first = sum(bool(o) and bool(r) and o[0] == r[0] for o, r in zip(outs, reference))
    return {"exact": outs == reference, "tokens_same": round(same / total, 3),
            "first_tokens_same": f"{first}/{len(reference)}"}


def _reinit_dummy_weights(worker) -> None:
    """Runs in the engine's GPU worker: vLLM's dummy loader on the woken (empty) weight buffers."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    runner = worker.model_runner
    DummyModelLoader(runner.load_config).load_weights(runner.get_model(), runner.model_config)


async def _restore_weights(engine, load_format: str) -> str:
    if load_format == "dummy":
        await engine.collective_rpc(_reinit_dummy_weights)
        return "dummy re-initialisation in the worker (vLLM DummyModelLoader)"
    await engine.collective_rpc("reload_weights")
    return "vLLM reload_weights (from the model folder)"


def _drop_page_cache() -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped: {exc}"


def _save(result: dict, path: str) -> None:
    """Written after every step, so a run cut short still leaves what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


async def _run(args: argparse.Namespace) -> dict:
    import vllm

    from turbine.vllm.canary import engine_canary
    from turbine.vllm.sleep import sleep_engine, wake_engine

    mem = GpuMemory()
    result: dict = {"gpu": mem.name, "driver": mem.driver, "vllm": vllm.__version__,
                    "python": platform.python_version(),
                    "model": args.model, "load_format": args.load_format, "cycles": args.cycles,
                    "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    try:
        import torch

        result["torch"] = torch.__version__
    except ImportError:
        pass
    result["memory_before_engine"] = mem.read()

    cfg, engine, start_s = _build_engine(args)
    vcfg = engine.vllm_config
    result.update(engine_start_s=round(start_s, 2), num_gpu_blocks=vcfg.cache_config.num_gpu_blocks,
                  block_size=vcfg.cache_config.block_size, dtype=str(vcfg.model_config.dtype),
                  gpu_memory_utilization=vcfg.cache_config.gpu_memory_utilization,
                  enable_prefix_caching=vcfg.cache_config.enable_prefix_caching,
                  enforce_eager=vcfg.model_config.enforce_eager)
    try:
        rng = random.Random(0)
        vocab = min(vcfg.model_config.get_vocab_size(), 32000)
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        await _generate(engine, prompts, args.max_tokens, "warm")  # first-run work out of the reference
        reference, gen_s = await _generate(engine, prompts, args.max_tokens, "ref")
        result["awake_start"] = {"memory": mem.read(), "generate_s": round(gen_s, 3),
                                 "is_sleeping": await engine.is_sleeping()}

        cycles = result["cycles"] = []
        _save(result, args.out)
        for level in (1, 2):
            for cycle in range(args.cycles):
                row: dict = {"level": level, "cycle": cycle}
                before = mem.read()
                t0 = time.perf_counter()
                await sleep_engine(engine, level)
                row["sleep_s"] = round(time.perf_counter() - t0, 3)
                row["asleep_memory"] = mem.read()
                row["asleep_is_sleeping"] = await engine.is_sleeping()
                row["freed_gib"] = round(before["used_gib"] - row["asleep_memory"]["used_gib"], 3)
                t0 = time.perf_counter()
                await wake_engine(engine)
                row["wake_s"] = round(time.perf_counter() - t0, 3)
                row["awake_memory"] = mem.read()
                row["awake_is_sleeping"] = await engine.is_sleeping()
                row["canary"] = await engine_canary(engine) or "ok"
                outs, gen_s = await _generate(engine, prompts, args.max_tokens, f"l{level}c{cycle}")
                row["generate_s"] = round(gen_s, 3)
                row["generate_tokens"] = sum(len(o) for o in outs)
                row["greedy_vs_reference"] = _agreement(outs, reference)
                if level == 2:
                    if args.drop_page_cache:
                        row["page_cache"] = _drop_page_cache()
                    t0 = time.perf_counter()
                    try:
                        row["weights_restored_by"] = await _restore_weights(engine, args.load_format)
                    except Exception as exc:  # recorded, and the run goes on: the sleep numbers stand alone
                        row["weights_restored_by"] = f"failed: {type(exc).__name__}: {exc}"
                    row["restore_weights_s"] = round(time.perf_counter() - t0, 3)
                    outs, _ = await _generate(engine, prompts, args.max_tokens, f"l{level}c{cycle}r")
                    row["after_restore_greedy_vs_reference"] = _agreement(outs, reference)
                cycles.append(row)
                print(json.dumps(row), flush=True)
                _save(result, args.out)
        result["cycles"] = cycles
        result["summary"] = _summary(result)
    finally:
        engine.shutdown()
    return result


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return round(xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2, 3)


def _summary(result: dict) -> dict:
    out = {"awake_used_gib": result["awake_start"]["memory"]["used_gib"]}
    for level in (1, 2):
        rows = [r for r in result["cycles"] if r["level"] == level]
        out[f"level{level}"] = {
            "asleep_used_gib": _median([r["asleep_memory"]["used_gib"] for r in rows]),
            "freed_gib": _median([r["freed_gib"] for r in rows]),
            "awake_used_gib": _median([r["awake_memory"]["used_gib"] for r in rows]),
            "sleep_s_median": _median([r["sleep_s"] for r in rows]),
            "wake_s_median": _median([r["wake_s"] for r in rows]),
            **({"restore_weights_s_median": _median([r["restore_weights_s"] for r in rows])} if level == 2 else {}),
            "greedy_tokens_same_after_wake": [r["greedy_vs_reference"]["tokens_same"] for r in rows],
            **({"greedy_tokens_same_after_weight_restore":
                [r["after_restore_greedy_vs_reference"]["tokens_same"] for r in rows]} if level == 2 else {}),
            "all_canaries_ok": all(r["canary"] == "ok" for r in rows),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # The dummy-weight restore is a function sent to the engine's worker (vLLM pickles callables only when allowed).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    result = asyncio.run(_run(args))
    try:
        result["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                               "--format=csv,noheader"], capture_output=True, text=True,
                                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    _save(result, args.out)
    print(json.dumps(result.get("summary"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

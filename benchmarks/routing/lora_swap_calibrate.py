"""What swapping a LoRA adapter into an active slot costs the real vLLM CPU engine: the value of the
mocker's --lora-load-time-ms default (turbine/mocker/timing.py).

vLLM's offline engine (the one the worker runs) on the embedded SmolLM2, `enable_lora` with one
active slot (`max_loras=1`) and both adapters held in its CPU cache (`max_cpu_loras=2`: loaded, as
on a worker where every adapter is loaded), prefix caching off. One-token requests on the same
prompt, in blocks that alternate: `same` (the adapter of the request before, already in the slot)
and `swap` (the other adapter: it must be copied into the slot before the prefill). The swap cost
is median(swap) - median(same). The adapters are real PEFT adapters (rank 16 on every linear
module, made with peft, as a fine-tune would be).

    flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.routing.lora_swap_calibrate --out /tmp/lora_swap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.paths import default_model
from benchmarks.lib.proc import log


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter with random weights for every linear module of the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False,
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    get_peft_model(model, config).save_pretrained(str(out))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10, help="blocks of each kind (alternating)")
    ap.add_argument("--per-block", type=int, default=5, help="requests per block")
    ap.add_argument("--dtype", default="float32", help="as the worker runs on this AVX2 host")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = args.model or default_model(sys.executable)
    work = Path(tempfile.mkdtemp(prefix="lora-swap-"))
    adapters = [build_adapter(model, work / f"adapter-{i}", args.rank, seed=i) for i in range(2)]
    log(f"adapters in {work}: {[a.name for a in adapters]}")
    size = sum(f.stat().st_size for a in adapters for f in a.iterdir()) // 2

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=args.rank,
              enforce_eager=True, max_model_len=2048, dtype=args.dtype, enable_prefix_caching=False)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.prompt_tokens))}

    def one(lora) -> float:
        started = time.perf_counter()
        llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - started

    for lora in loras * 3:  # into the CPU cache, and warm
        one(lora)
    times: dict[str, list[float]] = {"same": [], "swap": []}
    current = 1  # the warm-up ended on loras[1]: it is in the slot
    for r in range(2 * args.rounds):
        kind = ("same", "swap")[(r + r // 2) % 2]  # same, swap, swap, same, ... (ABBA)
        for _ in range(args.per_block):
            if kind == "swap":
                current = 1 - current
            times[kind].append(one(loras[current]))
    same, swap = statistics.median(times["same"]), statistics.median(times["swap"])
    result = {"model": model, "dtype": args.dtype, "rank": args.rank, "targets": TARGETS,
              "adapter_bytes": size, "prompt_tokens": args.prompt_tokens,
              "same_ms_median": same * 1e3, "swap_ms_median": swap * 1e3, "swap_cost_ms": (swap - same) * 1e3,
              "same_ms": [t * 1e3 for t in times["same"]], "swap_ms": [t * 1e3 for t in times["swap"]]}
    print(f"adapter {size / 1e6:.1f} MB (rank {args.rank}, {len(TARGETS)} modules); one-token request "
          f"({args.prompt_tokens}-token prompt): same adapter {same * 1e3:.1f} ms, swapped in {swap * 1e3:.1f} ms "
          f"(median of {len(times['same'])} each): swap cost {(swap - same) * 1e3:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

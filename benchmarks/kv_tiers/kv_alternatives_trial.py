"""Does a third-party KV connector run on the vLLM CPU build? One engine (SmolLM2, float32, 24 blocks of 128
tokens) with vLLM's OffloadingConnector (`offload`) or LMCache's LMCacheConnectorV1 (`lmcache`); four 1000-token
prompts (1, 2, 3, 1): the last one returns after two others pushed it out of the small engine cache, so a working
connector shows as cached tokens and a shorter time. Results and the reasons: docs/benchmarks/kv_tiers.md ("Multi-tier KV
cache"); run under the engine lock:

  flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.kv_tiers.kv_alternatives_trial offload MODEL_DIR
  LMCACHE_CHUNK_SIZE=128 LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=1 PYTHONPATH=LMCACHE_WHEEL_DIR:DEPS_DIR \
      flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.kv_tiers.kv_alternatives_trial lmcache MODEL_DIR
"""
import json, random, sys, time, traceback
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

def main():
    which = sys.argv[1]
    model = sys.argv[2]
    cfgs = {
        "offload": dict(kv_connector="OffloadingConnector", kv_role="kv_both",
                        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30}),
        "lmcache": dict(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
    }
    def prompt(seed):
        g = random.Random(seed)
        return {"prompt_token_ids": [g.randrange(1000, 49152) for _ in range(1000)]}
    try:
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1536, num_gpu_blocks_override=24,
                  kv_transfer_config=KVTransferConfig(**cfgs[which]), disable_log_stats=False)
    except Exception:
        traceback.print_exc()
        print(f"TRIAL {which}: engine did not start", flush=True)
        sys.exit(3)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    res = []
    for seed in (1, 2, 3, 1):
        t = time.monotonic()
        out = llm.generate([prompt(seed)], sp, use_tqdm=False)[0]
        res.append({"seed": seed, "s": round(time.monotonic() - t, 3), "cached": out.num_cached_tokens,
                    "text": out.outputs[0].token_ids})
    print("TRIAL", which, json.dumps(res), "same text:", res[0]["text"] == res[-1]["text"], flush=True)


if __name__ == "__main__":
    main()

"""vLLM's own offline answer with a LoRA adapter, the reference of test_lora_vllm.py: run as
`python -m tests.integration.lora_reference MODEL_DIR ADAPTER_DIR PROMPT_IDS_JSON MAX_TOKENS`
(a process of its own: its engine is gone when it exits), it prints one JSON line
{"base": [token ids...], "adapter": [token ids...]} of greedy outputs, with the engine settings
of the test's workers (tests/integration/procs.py ENGINE_FLAGS, float32, --enable-lora)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, adapter_dir, prompt_json, max_tokens = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=16,
              enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": json.loads(prompt_json)}
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens))
    base = llm.generate([prompt], params)[0].outputs[0].token_ids
    adapter = llm.generate([prompt], params, lora_request=LoRARequest("ref", 1, adapter_dir))[0].outputs[0].token_ids
    print(json.dumps({"base": list(base), "adapter": list(adapter)}), flush=True)


if __name__ == "__main__":
    main()

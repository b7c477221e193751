"""Writes a checkpoint of random weights for a model folder's config.json (the GPU hosts have no model files),
so a benchmark can load real safetensors from disk: python3 random_checkpoint.py SRC DST [device]. Copies the
tokenizer files along (not model*)."""
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
t0 = time.perf_counter()
cfg = transformers.AutoConfig.from_pretrained(src)
torch.set_default_dtype(torch.bfloat16)
with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(cfg)
model.save_pretrained(dst, max_shard_size="5GB")
for f in src.iterdir():
    if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
        shutil.copy(f, dst / f.name)
n = sum(p.numel() for p in model.parameters())
print(f"random checkpoint: {n / 1e9:.2f} B parameters, {time.perf_counter() - t0:.1f} s -> {dst}", flush=True)

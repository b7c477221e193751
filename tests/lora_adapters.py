"""Real LoRA adapters for the tests, made with peft (save_pretrained: adapter_config.json and
adapter_model.safetensors), on the embedded SmolLM2 model or on a tiny model of other shapes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def build_adapter(model_dir: str, out: Path, *, rank: int = 8, seed: int = 0,
                  targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")) -> Path:
    """A LoRA adapter for the model in `model_dir` whose random weights (init_lora_weights=False:
    both A and B random, scaled by lora_alpha / r = 2) change its greedy output."""
    if (out / "adapter_config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _save(model, out, rank, targets)


def build_tiny_adapter(out: Path, *, rank: int = 8) -> Path:
    """A LoRA adapter for a tiny Llama of another hidden size than SmolLM2 (a 'wrong base')."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152)
    return _save(LlamaForCausalLM(config), out, rank, ("q_proj", "v_proj"))


def _save(model, out: Path, rank: int, targets: tuple[str, ...]) -> Path:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False,
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    peft_model.save_pretrained(str(tmp))
    os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    return out


def corrupt_copy(adapter: Path, out: Path) -> Path:
    """The adapter with its weights file cut in half (a download that broke off)."""
    shutil.copytree(adapter, out)
    weights = out / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return out

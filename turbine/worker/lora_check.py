"""Checks of a LoRA adapter folder before any engine sees it, shared by every engine kind.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`. Checked: the
config is JSON with a LoRA rank `r` no larger than the worker's limit; the weights are
safetensors (a pickled `adapter_model.bin` is refused: nothing is ever unpickled here) whose
header is sound and whose data is all there (a truncated or garbled file is caught here, not in
the engine); and, when the base model is a local folder, every adapted module exists in the base
model with the shapes the adapter expects (an adapter made for another model is refused with
the module that differs). Only the headers are read (JSON), never the tensors."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


class AdapterError(Exception):
    """The adapter cannot be loaded; the message says why (shown to whoever loaded it)."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    base_model: str  # adapter_config.json's base_model_name_or_path ("" if absent)
    target_modules: tuple[str, ...]


def check_adapter(path: str, *, max_rank: int | None, model_dir: str | None) -> AdapterInfo:
    """The adapter's facts, or AdapterError. `max_rank`: the engine's largest rank (None: no
    limit); `model_dir`: the base model's local folder (None: shapes are left to the engine)."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"{path}: not a folder (a LoRA adapter is a folder with {CONFIG} and {WEIGHTS})")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG}: not a PEFT adapter folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}/{CONFIG} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}/{CONFIG} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {peft_type!r}: only LoRA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}/{CONFIG}: 'r' (the LoRA rank) must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"the adapter's rank is {rank}, above this worker's --max-lora-rank {max_rank}")
    weights = folder / WEIGHTS
    if not weights.is_file():
        if (folder / "adapter_model.bin").exists():
            raise AdapterError(f"{path}: adapter_model.bin is a pickle, which is never loaded here; "
                               f"save the adapter as safetensors (save_pretrained's default)")
        raise AdapterError(f"{path}: no {WEIGHTS}")
    tensors = safetensors_shapes(str(weights))
    loras, largest = _lora_shapes(tensors)
    if not loras:
        raise AdapterError(f"{path}/{WEIGHTS} holds no LoRA weights (lora_A / lora_B)")
    rank = max(rank, largest)  # peft's rank_pattern may give modules ranks of their own
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"the adapter's rank is {rank}, above this worker's --max-lora-rank {max_rank}")
    if model_dir is not None:
        _check_base(loras, model_dir)
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):
        targets = (targets,)
    return AdapterInfo(rank=rank, base_model=str(config.get("base_model_name_or_path") or ""),
                       target_modules=tuple(map(str, targets)))


def safetensors_shapes(file: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header, after checking that the header is
    sound and the file holds every tensor's bytes."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise AdapterError(f"{file}: too short to be safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise AdapterError(f"{file}: corrupt safetensors header (declares {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise AdapterError(f"{file}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: corrupt safetensors header")
    data = size - 8 - n
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
            shape = [int(d) for d in entry["shape"]]
        except (TypeError, KeyError, ValueError):
            raise AdapterError(f"{file}: corrupt safetensors header entry {name!r}") from None
        if not 0 <= start <= end <= data:
            raise AdapterError(f"{file}: truncated or corrupt: tensor {name!r} lies beyond the file's end")
        shapes[name] = shape
    return shapes


def _lora_shapes(tensors: dict[str, list[int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Base weight name -> (out, in) that the adapter's lora_A / lora_B pair expects, and the
    largest rank among them."""
    out: dict[str, tuple[int, int]] = {}
    largest = 0
    for name, shape in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise AdapterError(f"{name} has no lora_B partner")
        if len(shape) != 2 or len(b) != 2 or shape[0] != b[1]:
            raise AdapterError(f"{name}: lora_A {shape} and lora_B {b} do not make a low-rank pair")
        largest = max(largest, shape[0])
        base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        out[base] = (b[0], shape[1])
    return out, largest


def _check_base(loras: dict[str, tuple[int, int]], model_dir: str) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return  # not a safetensors folder: the engine checks
    base: dict[str, list[int]] = {}
    for file in files:
        base.update(safetensors_shapes(str(file)))
    for name, (rows, cols) in sorted(loras.items()):
        shape = base.get(name)
        if shape is None:
            raise AdapterError(f"wrong base model: the adapter adapts {name}, which this worker's model does not have")
        if list(shape) != [rows, cols]:
            raise AdapterError(f"wrong base model: {name} is {list(shape)} in this worker's model, the adapter "
                               f"expects {[rows, cols]}")

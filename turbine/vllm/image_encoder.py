"""The encode worker's model: a vision-language model's vision tower and projector alone, loaded with
transformers from the model folder's own weights file, that turn a decoded image into the embeddings the
language tower takes in place of the image's placeholder tokens (one row per placeholder, the language
tower's width).

Why transformers and not vLLM's encoder-only engine (`--mm-encoder-only` / an `ec_producer`): vLLM's
producer keeps the embeddings inside its engine process and hands them on only through its own EC
connectors (a shared-storage example and Mooncake in 0.32, no NIXL one), so the worker could neither hold
them in its byte-bounded cache nor serve them from its own NIXL buffers; and it would start a whole engine
(scheduler, KV profiling, a core busy-polling) for a forward pass of a few layers. Here the encode worker
is one process: the image processor and the two modules, the cache, the transfer buffers.

Parity: the same preprocessing (the folder's image processor, which vLLM also runs) and the same weights
in the same dtype; the forward is transformers' implementation of the layers, vLLM's consumer takes the
result as its encoder output (turbine/vllm/ec_connector.py). Greedy tokens match the aggregated engine's in
float32 (tests/integration/test_multimodal_disagg.py).

Architectures: Idefics3 (SmolVLM's). Others are refused at start, naming the architecture."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

SUPPORTED = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EncoderUnsupported(ValueError):
    pass


@dataclass(frozen=True)
class EncoderSpec:
    architecture: str
    hidden_size: int  # the language tower's width: each embedding row's length


def spec_of(model_path: str) -> EncoderSpec:
    """What the folder's config says, or EncoderUnsupported naming why the encode worker cannot serve it."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise EncoderUnsupported(f"cannot read {path}: {exc}") from None
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise EncoderUnsupported(f"the encode worker runs {', '.join(SUPPORTED)} vision towers; the model is "
                                 f"{', '.join(archs) or 'of no known architecture'}")
    return EncoderSpec(arch, int(config["text_config"]["hidden_size"]))


def default_device() -> torch.device:
    """The GPU where there is one (as vLLM picks its platform), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class ImageEncoder:
    """The vision tower and projector of an Idefics3-family model, in `dtype`, on `device` (default: the GPU
    where there is one); embeddings come back in host memory, where the cache and both transports keep them."""

    def __init__(self, model_path: str, dtype: str = "float32", device: torch.device | None = None):
        from safetensors import safe_open
        from transformers import AutoConfig, AutoImageProcessor
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        if dtype not in DTYPES:
            raise EncoderUnsupported(f"dtype {dtype!r}: choose from {', '.join(DTYPES)}")
        self.spec = spec_of(model_path)
        self.dtype = DTYPES[dtype]
        config = AutoConfig.from_pretrained(model_path)
        self.config = config
        self.vision = Idefics3VisionTransformer._from_config(config.vision_config)
        self.connector = Idefics3Connector(config)
        state = {"vision": {}, "connector": {}}
        files = [f for f in sorted(os.listdir(model_path)) if f.endswith(".safetensors")]
        for name in files:
            with safe_open(os.path.join(model_path, name), "pt") as weights:
                for key in weights.keys():
                    for prefix, part in (("model.vision_model.", "vision"), ("model.connector.", "connector")):
                        if key.startswith(prefix):
                            state[part][key[len(prefix):]] = weights.get_tensor(key)
        self.vision.load_state_dict(state["vision"], strict=True)
        self.connector.load_state_dict(state["connector"], strict=True)
        self.device = device or default_device()
        self.vision.to(self.device, self.dtype).eval()
        self.connector.to(self.device, self.dtype).eval()
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.patch_size = config.vision_config.patch_size

    @torch.inference_mode()
    def encode(self, image) -> torch.Tensor:
        """One RGB PIL image → its embeddings, (placeholder tokens, hidden size), contiguous, in the dtype."""
        batch = self.processor(images=[[image]], return_tensors="pt")
        pixels = batch["pixel_values"]  # (1, crops, 3, H, W)
        pixels = pixels.reshape(-1, *pixels.shape[2:]).to(self.device, self.dtype)
        mask = batch.get("pixel_attention_mask")
        if mask is None:
            mask = torch.ones(pixels.shape[0], pixels.shape[2], pixels.shape[3], dtype=torch.bool)
        else:
            mask = mask.reshape(-1, *mask.shape[2:]).bool()
        p = self.patch_size
        patches = mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).to(self.device)
        hidden = self.vision(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
        features = self.connector(hidden)  # (crops, tokens per crop, hidden size)
        return features.reshape(-1, features.shape[-1]).to("cpu").contiguous()

"""A vision-language model for the tests, built locally (no vision-language weights can be downloaded here):
SmolVLM-style, that is Idefics3 (vLLM's Idefics3ForConditionalGeneration) with the embedded SmolLM2-135M-Instruct
as its language tower and a tiny SigLIP-like vision tower + pixel-shuffle projector, random with a fixed seed.
Its answers are meaningless but deterministic, which is what parity tests need: the same image gives the same
greedy tokens, another image other tokens. Same seed, same bytes.

Why not LLaVA: vLLM 0.32's llava.py imports its pixtral module, which imports transformers' torchvision-backed
Pixtral image processor, and torchvision does not load beside this torch (see README, `make setup`); so every
LLaVA-family model fails vLLM's architecture inspection here (Qwen2-VL, Gemma3 too). Idefics3 imports cleanly, and
its image processor has a PIL backend (Idefics3ImageProcessorPil), which AutoProcessor picks without torchvision.

The folder holds config.json (an Idefics3Config), safetensors, and an Idefics3Processor: the PIL image processor
(no tiling: one 64x64 image per picture), SmolLM2's tokenizer with the Idefics3 image tokens added, and a ChatML
chat template that places images.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 64  # pixels a side the vision tower sees
PATCH_SIZE = 8
SCALE_FACTOR = 2  # pixel shuffle: (64 / 8)^2 = 64 patches → 16 embeddings per image
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# What Idefics3's processor expects in the vocabulary (it looks the row/col and global tags up by name).
ADDED_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]

# ChatML like SmolLM2's own template, but content may be a list of parts: an image part becomes the image token
# (the processor widens it to the image's placeholder), a text part its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiled() -> bool:
    """TURBINE_TEST_VLM_TILES=1: pictures split into tiles (see build_vlm)."""
    return os.environ.get("TURBINE_TEST_VLM_TILES") == "1"


def build_vlm(out: Path, *, text_model_dir: str | None = None, seed: int = 0) -> Path:
    """Build the model into `out` (once: a finished folder is reused) and return it."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    if text_model_dir is None:
        from turbine.model.prepare import prepare

        text_model_dir = str(prepare())
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE

    text = AutoModelForCausalLM.from_pretrained(text_model_dir, dtype=torch.float32)
    old_vocab = text.get_input_embeddings().weight.shape[0]
    text.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        # The new rows (image tags; the image token's own row is replaced by image embeddings) must not depend
        # on an unseeded init: the mean of the old rows.
        emb = text.get_input_embeddings().weight
        emb[old_vocab:] = emb[:old_vocab].mean(dim=0)

    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.config.to_dict(),
                            scale_factor=SCALE_FACTOR, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                            tie_word_embeddings=True, pad_token_id=text.config.pad_token_id)
    model = Idefics3ForConditionalGeneration(config)
    # Draw every vision/projector weight from our own seeded generator, in name order, so the bytes depend on the
    # seed alone (not on transformers' init order), at a scale where the image moves the answer.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not name.startswith(("model.vision_model.", "model.connector.")):
                continue
            if param.dim() > 1:
                # The projector 3x louder than unit scale: at 1x two different pictures often gave the same greedy
                # answer (the language tower barely heard the image); at 3x they part within a few tokens.
                gain = 3.0 if name.startswith("model.connector.") else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[-1] ** 0.5)
            elif "norm" in name and name.endswith(".weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        model.model.text_model.load_state_dict(text.model.state_dict())
        model.lm_head.weight = model.model.text_model.embed_tokens.weight
    model = model.to(torch.bfloat16)

    if tiled():
        # A picture resized to twice the tile and split into tiles plus the whole (global) image, as SmolVLM
        # does: vLLM 0.26 counts the crops of an unsplit picture as 0 (its Idefics3 lacks 0.32's max(n, 1)) and
        # drops the image, so the GPU release's runs use this form (benchmarks/gpu/gpu_tests.sh).
        image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                                    max_image_size={"longest_edge": IMAGE_SIZE},
                                                    do_image_splitting=True)
    else:
        image_processor = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE},
                                                    max_image_size={"longest_edge": IMAGE_SIZE},
                                                    do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                                  chat_template=CHAT_TEMPLATE)

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    return out


if __name__ == "__main__":
    import sys

    print(build_vlm(Path(sys.argv[1])))

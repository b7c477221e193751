"""vLLM's own offline answers on the test vision-language model (tests/multimodal_model.py), for
test_multimodal_model.py: run as `python -m tests.integration.multimodal_reference MODEL_DIR MAX_TOKENS` (a process
of its own: vLLM spawns its engine core, and the engine is gone when it exits). It chats with Pillow-made pictures
(PNG data URLs, as a client sends them) and prints one JSON line {"answers": {name: [token ids...]}} of greedy
outputs: one batch of red, blue, green, red again, then red alone in a second call."""

from __future__ import annotations

import base64
import io
import json
import os
import sys


def picture(color: tuple[int, int, int], size: tuple[int, int]):
    """A solid picture with stripes of the inverse color every 6 columns."""
    from PIL import Image

    image = Image.new("RGB", size, color)
    inverse = tuple(255 - c for c in color)
    for x in range(0, size[0], 6):
        for y in range(size[1]):
            image.putpixel((x, y), inverse)
    return image


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PICTURES = {"red": ((200, 30, 30), (48, 40)), "blue": ((20, 40, 220), (48, 40)), "green": ((30, 200, 30), (20, 60))}


def chat(name: str) -> list[dict]:
    url = data_url(picture(*PICTURES[name]))
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe the picture."}]}]


def main() -> None:
    model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0,
              limit_mm_per_prompt={"image": 1})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    names = ["red", "blue", "green", "red"]
    outs = llm.chat([chat(n) for n in names], params)
    answers = {f"{n}#{i}": list(o.outputs[0].token_ids) for i, (n, o) in enumerate(zip(names, outs))}
    answers["red-alone"] = list(llm.chat([chat("red")], params)[0].outputs[0].token_ids)
    print(json.dumps({"answers": answers}), flush=True)


if __name__ == "__main__":
    main()

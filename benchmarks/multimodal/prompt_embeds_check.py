"""Cost of a prompt_embeds payload on each side, no engine: the frontend's check (base64 via
pybase64, off the event loop above 256 KiB: the loop keeps ticking meanwhile) and the vLLM
worker's weights-only load and checks.

    .venv/bin/python -m benchmarks.multimodal.prompt_embeds_check
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

import torch

from turbine.frontend.models.table import ServedModel
from turbine.frontend.preprocess.prompt_embeds import prompt_embeds_payload
from turbine.protocol.discovery import ModelCard
from turbine.vllm.prompt_embeds import load_prompt_embeds

HIDDEN, CONTEXT, REPEATS = 576, 2048, 50  # SmolLM2-135M


async def frontend_check(model: ServedModel, b64: str) -> tuple[float, float]:
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    for _ in range(REPEATS):
        await prompt_embeds_payload(b64, model, 4 << 20)
    took = (time.perf_counter() - start) / REPEATS
    task.cancel()
    return took, ticks / REPEATS


def main() -> None:
    card = ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id="x",
                     tokenizer_path="", context_length=CONTEXT, kv_block_size=16, total_kv_blocks=1, max_num_seqs=1,
                     max_num_batched_tokens=CONTEXT, accepts_prompt_embeds=True)
    model = ServedModel("m", card, None, None)
    for rows in (6, 512, 1800):
        buf = io.BytesIO()
        torch.save(torch.randn(rows, HIDDEN), buf)
        raw = buf.getvalue()
        took, ticks = asyncio.run(frontend_check(model, base64.b64encode(raw).decode()))
        start = time.perf_counter()
        for _ in range(REPEATS):
            load_prompt_embeds(raw, hidden_size=HIDDEN, dtype=torch.float32, max_model_len=CONTEXT)
        load = (time.perf_counter() - start) / REPEATS
        print(f"rows={rows:5d} payload={len(raw) / 1e6:5.2f} MB  frontend check {took * 1e3:7.3f} ms "
              f"(event-loop ticks meanwhile: {ticks:.0f})  worker load+checks {load * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()

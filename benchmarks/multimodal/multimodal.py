#!/usr/bin/env python3
r"""Image chats (issue #19): aggregated vs E/PD on the same cores, and the encode worker's embedding cache.

Setups, one at a time, each on private file discovery (benchmarks/lib/stack.py), same engine flags:

agg   one vLLM worker `--enable-multimodal` (the engine encodes the images) + a frontend.
epd   an encode worker (`--multimodal-encode-worker`, the vision tower alone) + one vLLM worker
      `--enable-multimodal --take-image-embeddings` + a frontend (`--image-embedding-transport nixl`).

Model: the tests' vision-language model (tests/multimodal_model.py: Idefics3 with SmolLM2-135M's language tower,
a 2-layer 64-wide vision tower on 64x64 pictures, 16 image tokens), float32. Both setups share the machine's cores
(on this host: 2); the engine binds its compute threads as vLLM does.

Load: closed loop, --concurrency clients (each point), --requests chats per point, each one picture (64x64
random pixels) and a short question, streaming, max_tokens --max-tokens with ignore_eos, the official openai
client. Two workloads per point: `unique` (every picture new) and `half` (50 % of the requests repeat a picture
sent earlier in the point). Prefix caching is off in the engines, so a repeated picture saves only the encoder
run (the encode worker's cache in epd; the engine's own encoder cache in agg), not the prompt's KV.

Reported per setup, workload and concurrency: TTFT p50/p90, requests/s, output tokens/s, and for epd the
encoder runs and cache hits (the encode worker's counters). Setups alternate (agg, epd | epd, agg); values are
medians over --repeats.

  .venv/bin/python -m benchmarks.multimodal.multimodal --repeats 2 --concurrency 1,4 --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.proc import log
from benchmarks.lib.stack import Stack, turbine_env


SERVED = "tiny-vlm"
ENGINE = ["--served-model-name", SERVED, "--enable-multimodal", "--enforce-eager", "--dtype", "float32",
          "--max-model-len", "512", "--max-num-seqs", "8", "--no-enable-prefix-caching"]


def picture_url(seed: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (64, 64), bytes(rng.randrange(256) for _ in range(64 * 64 * 3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def workload(kind: str, n: int, seed: int) -> list[int]:
    """Picture seeds, one per request: all new (`unique`), or every second one a repeat of an earlier one."""
    rng = random.Random(seed)
    seeds: list[int] = []
    for i in range(n):
        if kind == "half" and i % 2 == 1:
            seeds.append(rng.choice(seeds))
        else:
            seeds.append(seed * 100_000 + i)
    return seeds


async def run_point(url: str, seeds: list[int], concurrency: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    images = {s: picture_url(s) for s in set(seeds)}
    queue = list(enumerate(seeds))
    ttfts: list[float] = []
    tokens = 0

    async def one(seed: int) -> None:
        nonlocal tokens
        t0 = time.monotonic()
        first = None
        stream = await client.chat.completions.create(
            model=SERVED, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[seed]}},
                                                   {"type": "text", "text": "Describe the picture."}]}])
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        ttfts.append(first if first is not None else time.monotonic() - t0)

    async def worker() -> None:
        while queue:
            _, seed = queue.pop(0)
            await one(seed)

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - start
    await client.close()
    ttfts.sort()
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "req_s": len(seeds) / wall, "out_tok_s": tokens / wall, "wall_s": wall}


def metric(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def start(setup: str, model: str, run_dir: Path, tag: str) -> tuple[Stack, str | None]:
    from turbine.runtime.ports import free_port

    stack = Stack(setup, run_dir, tag)
    disc = tempfile.mkdtemp(prefix="discovery_", dir=run_dir)
    env = turbine_env(disc, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    py = sys.executable
    encoder_url = None
    if setup == "epd":
        port = free_port()
        encoder_url = f"http://127.0.0.1:{port}"
        stack.spawn("encoder", [py, "-m", "turbine.vllm", "--model", model, "--served-model-name", SERVED,
                                "--multimodal-encode-worker", "--dtype", "float32", "--system-port", str(port)], env)
        worker = [*ENGINE, "--take-image-embeddings"]
    else:
        worker = ENGINE
    stack.spawn("worker", [py, "-m", "turbine.vllm", "--model", model, *worker], env)
    stack.spawn("frontend", [py, "-m", "turbine.frontend", "--http-port", str(stack.port),
                             "--image-embedding-transport", "nixl"], env)

    def ready() -> bool:
        import urllib.request

        body = json.loads(urllib.request.urlopen(f"{stack.base_url}/health", timeout=5).read())
        return SERVED in (body.get("models") or {}) and (
            setup == "agg" or (body.get("encode_workers") or {}).get(SERVED) == 1)

    stack.wait_ready(ready, 600)
    return stack, encoder_url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/turbine/bench-tiny-vlm"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from tests.multimodal_model import build_vlm

    model = str(build_vlm(Path(a.model_dir)))
    run_dir = Path(tempfile.mkdtemp(prefix="bench_multimodal_"))
    conc = [int(c) for c in a.concurrency.split(",")]
    results: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        order = ("agg", "epd") if rep % 2 == 0 else ("epd", "agg")
        for setup in order:
            stack, enc = start(setup, model, run_dir, f"{setup}{rep}")
            try:
                asyncio.run(run_point(stack.base_url, workload("unique", 2, 999 + rep), 1, 4))  # warm-up
                for c in conc:
                    for kind in ("unique", "half"):
                        before = (metric(enc, "turbine_encoder_images_total"),
                                  metric(enc, "turbine_embedding_cache_hits_total")) if enc else (0, 0)
                        # Every point its own pictures: none was seen in an earlier point (by the cache or engine).
                        seed = 1 + rep * 10 + c + (1000 if kind == "half" else 0)
                        point = asyncio.run(run_point(stack.base_url, workload(kind, a.requests, seed), c,
                                                      a.max_tokens))
                        if enc:
                            point["encoder_runs"] = metric(enc, "turbine_encoder_images_total") - before[0]
                            point["cache_hits"] = metric(enc, "turbine_embedding_cache_hits_total") - before[1]
                        key = f"{setup} {kind} c={c}"
                        results.setdefault(key, []).append(point)
                        log(f"{key} rep {rep}: " + ", ".join(f"{k}={v:.3g}" for k, v in point.items()))
            finally:
                stack.stop()
    summary = {key: {k: statistics.median(p[k] for p in points) for k in points[0]} for key, points in results.items()}
    print("\n| setup | workload | C | TTFT p50 (s) | TTFT p90 (s) | req/s | out tok/s | encoder runs | cache hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, s in summary.items():
        setup, kind, c = key.split()
        print(f"| {setup} | {kind} | {c[2:]} | {s['ttft_p50']:.3f} | {s['ttft_p90']:.3f} | {s['req_s']:.2f} | "
              f"{s['out_tok_s']:.1f} | {s.get('encoder_runs', '-')} | {s.get('cache_hits', '-')} |")
    for c in conc:
        for kind in ("unique", "half"):
            agg, epd = summary.get(f"agg {kind} c={c}"), summary.get(f"epd {kind} c={c}")
            if agg and epd:
                print(f"epd/agg {kind} c={c}: TTFT p50 x{epd['ttft_p50'] / agg['ttft_p50']:.2f}, "
                      f"req/s x{epd['req_s'] / agg['req_s']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"host": platform.node(), "args": vars(a), "runs": results,
                                           "summary": summary}, indent=1))


if __name__ == "__main__":
    main()

"""Disaggregated encode (issue #19): E/PD and E/P/D on real vLLM CPU engines, real NIXL, the official openai
client, and the test vision-language model (tests/multimodal_model.py).

Two engines for the whole module: a prefill and a decode worker, both `--enable-multimodal
--take-image-embeddings`; two frontends on them: one prefills on the decode worker and moves embeddings by
file (aggregated with no encode worker, E/PD with one), the other sends every prompt through the prefill
worker and moves embeddings over NIXL (E/P/D). The encode workers (`--multimodal-encode-worker`: the vision
tower alone, no engine) start and stop within the test, which goes in phases:

1. no encode worker: the decode worker encodes (aggregated): red and blue pictures, greedy tokens;
2. an encode worker: E/PD (file) and E/P/D (NIXL) give the same tokens per picture; the encoder runs once per
   picture (its cache answers the repeats: turbine_encoder_images_total, turbine_embedding_cache_hits_total);
3. an encode worker whose vision tower has other weights (seed 1): other tokens, so the engines did take the
   encode worker's embeddings (they have the pictures too, and would otherwise have encoded them the same).

Between phases the engines' prefix and encoder caches are cleared (clear_kv_blocks), so each phase computes.
float32 everywhere, so greedy tokens must match exactly. Run it under the engine lock."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT
from tests.integration.test_disagg_vllm import request_plane_address
from tests.integration.procs import (
    _start,
    base_env,
    http_json,
    http_text,
    instances_of,
    metric,
    mp_layout,
    prefill_workers_of,
    start_frontend,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.multimodal_model import build_vlm, tiled
from turbine.protocol.generate import ClearKvBlocksRequest, StatusReply
from turbine.runtime.request_plane import RequestPlaneClient
from turbine.serve import split_cpu_cores

VLM = "tiny-vlm"
MAX_TOKENS = 8
ENGINE = ["--served-model-name", VLM, "--enable-multimodal", "--take-image-embeddings", "--enforce-eager",
          "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--connector", "nixl"]
PICTURES = {"red": (200, 30, 30), "blue": (20, 40, 220)}


def picture_url(color: tuple[int, int, int]) -> str:
    from PIL import Image

    image = Image.new("RGB", (48, 40), color)
    inverse = tuple(255 - c for c in color)
    for x in range(0, 48, 6):
        for y in range(40):
            image.putpixel((x, y), inverse)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory, model_dir) -> dict[int, str]:
    root = tmp_path_factory.mktemp("vlm")
    return {seed: str(build_vlm(root / f"seed{seed}", text_model_dir=model_dir, seed=seed)) for seed in (0, 1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, vlm_dirs):
    root = tmp_path_factory.mktemp("vlm-disagg")
    env = mp_layout(base_env(str(root / "discovery")))  # the connectors' worker halves in vLLM CPU's own layout
    prefill_env, decode_env = (dict(env, **cpus) for cpus in split_cpu_cores(env))
    model = ["--model", vlm_dirs[0], *ENGINE]
    prefill = _start("prefill", prefill_env, root, "turbine.vllm", "--system-port", *model,
                     "--disaggregation-mode", "prefill")
    decode = _start("decode", decode_env, root, "turbine.vllm", "--system-port", *model,
                    "--disaggregation-mode", "decode")
    local = start_frontend("frontend-file", env, root, "--max-local-prefill-length", "1000000",
                           "--image-embedding-transport", "file")
    remote = start_frontend("frontend-nixl", env, root, "--max-local-prefill-length", "0",
                            "--image-embedding-transport", "nixl")
    procs = [prefill, decode, local, remote]
    state = {"env": env, "root": root, "prefill": prefill, "decode": decode, "local": local, "remote": remote,
             "procs": procs}
    try:
        wait_until(lambda: worker_ready(prefill) and worker_ready(decode), ENGINE_START_TIMEOUT,
                   "prefill and decode workers ready", procs)
        wait_until(lambda: all(instances_of(f, VLM) == 1 and prefill_workers_of(f, VLM) == 1
                               for f in (local, remote)), 30, "both frontends see both workers", procs)
        yield state
    finally:
        stop_all(procs)


def _health(frontend) -> dict:
    return http_json(f"{frontend.url}/health")[1]


def encode_workers(frontend) -> int:
    return _health(frontend).get("encode_workers", {}).get(VLM, 0)


def start_encoder(cluster, name: str, model_dir: str):
    enc = _start(name, cluster["env"], cluster["root"], "turbine.vllm", "--system-port", "--model", model_dir,
                 "--served-model-name", VLM, "--multimodal-encode-worker", "--dtype", "float32")
    cluster["procs"].append(enc)
    wait_until(lambda: worker_ready(enc), 120, f"{name} ready", cluster["procs"])
    wait_until(lambda: all(encode_workers(f) == 1 for f in (cluster["local"], cluster["remote"])), 30,
               "both frontends see the encode worker", cluster["procs"])
    return enc


def stop_encoder(cluster, enc) -> None:
    enc.stop()
    cluster["procs"].remove(enc)
    wait_until(lambda: all(encode_workers(f) == 0 for f in (cluster["local"], cluster["remote"])), 30,
               "the encode worker gone from both frontends", cluster["procs"])


def clear_caches(cluster) -> None:
    """The engines' prefix and encoder caches emptied, so the next request computes its prompt again."""

    async def run():
        rp = RequestPlaneClient()
        try:
            for worker in (cluster["prefill"], cluster["decode"]):
                replies = [r async for r in rp.stream(request_plane_address(worker), "clear_kv_blocks",
                                                      ClearKvBlocksRequest(), StatusReply)]
                assert replies[-1].status == "success", replies
        finally:
            await rp.close()

    asyncio.run(run())


def tokens(frontend, color) -> list[str]:
    oai = OpenAI(base_url=f"{frontend.url}/v1", api_key="x", max_retries=0, timeout=300)
    reply = oai.chat.completions.create(
        model=VLM, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture_url(color)}},
                                               {"type": "text", "text": "Describe the picture."}]}])
    # The engine's prompt: the image widened to its 16 tokens and tags (tiled: 4 tiles and the whole, 16 each).
    assert reply.usage.prompt_tokens == (127 if tiled() else 53)
    return [t.token for t in reply.choices[0].logprobs.content]


def counter(proc, name: str) -> float:
    return metric(http_text(f"{proc.url}/metrics"), name)


def remote_prefills(frontend) -> float:
    lines = [line for line in http_text(f"{frontend.url}/metrics").splitlines() if '"remote"' in line]
    return metric("\n".join(lines), "turbine_frontend_prefills_total")


def test_aggregated_epd_and_epd_give_the_same_tokens_and_the_encoder_runs_once_per_image(cluster, vlm_dirs):
    local, remote = cluster["local"], cluster["remote"]
    # 1. Aggregated: no encode worker, the decode worker's engine encodes the pictures itself.
    aggregated = {name: tokens(local, color) for name, color in PICTURES.items()}
    assert len(aggregated["red"]) == MAX_TOKENS and aggregated["red"] != aggregated["blue"]

    # 2. An encode worker: E/PD with the embeddings in a file, E/P/D over NIXL.
    clear_caches(cluster)
    enc = start_encoder(cluster, "encoder", vlm_dirs[0])
    assert counter(enc, "turbine_encoder_images_total") == 0
    assert tokens(local, PICTURES["red"]) == aggregated["red"]  # E/PD, file
    assert counter(enc, "turbine_encoder_images_total") == 1
    clear_caches(cluster)
    before = remote_prefills(remote)
    assert tokens(remote, PICTURES["red"]) == aggregated["red"]  # E/P/D, NIXL
    assert remote_prefills(remote) == before + 1  # it did go through the prefill worker
    # The same picture again: the encode worker's cache answered, the encoder did not run.
    assert counter(enc, "turbine_encoder_images_total") == 1
    assert counter(enc, "turbine_embedding_cache_hits_total") == 1
    # Another picture runs the encoder.
    assert tokens(remote, PICTURES["blue"]) == aggregated["blue"]  # E/P/D, NIXL
    assert counter(enc, "turbine_encoder_images_total") == 2
    assert counter(enc, "turbine_embedding_cache_hits_total") == 1
    stop_encoder(cluster, enc)

    # 3. An encode worker with other vision weights: the engines took its embeddings, so the tokens change.
    clear_caches(cluster)
    other = start_encoder(cluster, "encoder-seed1", vlm_dirs[1])
    assert tokens(local, PICTURES["red"]) != aggregated["red"]
    assert counter(other, "turbine_encoder_images_total") == 1
    stop_encoder(cluster, other)

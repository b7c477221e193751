"""Issue #35 §2: the omni worker (vLLM-Omni pipelines) on a GPU, through the `openai` client.

  python -m benchmarks.gpu.gpu_omni [--phase text|image|all] [--out FILE] [--dry-run] ...

Phase `text` (one-stage text pipeline): the embedded SmolLM2 (converted by gpu_install.sh) served twice, by the
plain vLLM worker and by an omni worker whose one LLM stage is the same model with the same engine settings;
greedy chats and completions, streamed and not, must give the same text and the same usage.
Phase `image` (two-stage text→image pipeline): stage 0 the same SmolLM2 (its text becomes the prompt of stage 1:
benchmarks/gpu/omni_stage_input.py), stage 1 a tiny Stable Diffusion pipeline with random weights built here
(diffusers + transformers from configs, a byte-level CLIP tokenizer written here: nothing is downloaded) and run
by vLLM-Omni's diffusers backend. Checks: /v1/images/generations and an image chat return PNGs Pillow opens at
the asked (or the pipeline's default) size; the same seed gives the same image; a request cancelled mid-pipeline
leaves nothing in flight after 3 s and the next request runs; then end-to-end and per-stage latency through
Turbine against AsyncOmni called directly in one process (a child process driven in rounds of alternating
order), medians of the repeats: direct / Turbine must be >= 0.95.

Every check prints PASS or FAIL (with the full traceback on an exception) and the run goes on with the others;
the result is one JSON file (--out, updated phase by phase) and every process's log is under --logs.
--dry-run builds the tiny model and writes the stage configs (CPU is enough), starts nothing, and writes the JSON.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import yaml

from benchmarks.gpu.gpu_serving import Procs
from benchmarks.gpu.gpu_serving import machine as gpu_machine
from benchmarks.lib.paths import REPO_ROOT
from benchmarks.lib.proc import exit_on_sigterm

H8 = Path(os.environ.get("H8", "/tmp/h8"))
PLAIN, OMNI_TEXT, OMNI_IMAGE = "smollm2-plain", "smollm2-omni", "omni-image"
PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "Count from one to five."]
# Raw completions need text to continue: SmolLM2 ends two of the chat questions above at once (an empty text on
# both workers, 2026-11-29 on an H200), which proves nothing.
COMPLETION_PROMPTS = ["The capital of France is", "The sea is", "One, two, three,"]
IMAGE_PROMPT = "a lighthouse on a cliff at dusk"


def log(msg: str) -> None:
    print(f"[gpu_omni {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- the tiny text→image model
def clip_byte_tokenizer(folder: Path) -> None:
    """A CLIP tokenizer with no merges: every byte its own token (CLIP's byte-to-unicode alphabet, each with and
    without the end-of-word mark), so any prompt tokenizes; CLIPTokenizer reads it as it reads OpenAI's."""
    from transformers.models.clip.tokenization_clip import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in chars]
    alphabet = [chr(c) for c in chars] + [chr(256 + i) for i in range(len(extra))]
    vocab = {}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    for ch in alphabet:
        vocab[ch + "</w>"] = len(vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    # transformers 5 builds it from the vocabulary itself (its `vocab` / `merges`); 4.x read the two files.
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    if len(tok) != len(vocab):
        raise RuntimeError(f"the byte tokenizer has {len(tok)} tokens, not {len(vocab)}")
    tok.save_pretrained(str(folder))


def build_tiny_sd(out: Path, seed: int = 0) -> dict:
    """A Stable Diffusion pipeline (UNet2DConditionModel, AutoencoderKL with 4 blocks: 8× downscale, CLIP text
    encoder, the byte tokenizer, Euler scheduler) with random weights, saved in diffusers' layout."""
    if (out / "model_index.json").exists():
        return {"path": str(out), "built": False}
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    from transformers.models.clip.tokenization_clip import CLIPTokenizer

    tmp = out.with_name(out.name + ".tmp")
    torch.manual_seed(seed)
    clip_byte_tokenizer(tmp / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp / "tokenizer"))
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id))
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 32, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
        sample_size=128)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(out)
    params = sum(p.numel() for m in (unet, vae, text_encoder) for p in m.parameters())
    return {"path": str(out), "built": True, "parameters": params}


def smoke_tiny_sd(path: Path, size: int = 64, steps: int = 2) -> dict:
    """The tiny pipeline run by diffusers itself (CPU is enough), called as vLLM-Omni's diffusers backend calls it
    (the sampling fields its __call__ takes: size, steps, guidance, guidance_rescale and eta at their defaults,
    num_images_per_prompt, a seeded generator): images of the asked size, the same for the same seed."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path))
    runs = []
    for _ in range(2):
        images = pipe(prompt="a cat", height=size, width=size, num_inference_steps=steps, guidance_scale=3.0,
                      guidance_rescale=0.0, eta=0.0, num_images_per_prompt=2,
                      generator=torch.Generator().manual_seed(3)).images
        runs.append([(im.size, im.tobytes()) for im in images])
    sizes = [sz for sz, _ in runs[0]]
    return {"ok": sizes == [(size, size)] * 2 and runs[0] == runs[1], "why": f"sizes {sizes}",
            "class": type(pipe).__name__, "sizes": sizes, "same_seed_same_images": runs[0] == runs[1]}


# --------------------------------------------------------------------------- the stage configs
def llm_stage(a, model: str, final: bool, max_tokens: int, ignore_eos: bool) -> dict:
    """An LLM stage of vLLM-Omni's legacy `stage_args` format: its AR worker and scheduler (as its deploy configs
    resolve an `llm_ar` stage), the plain worker's engine settings (eager, the same length and KV bytes)."""
    params = {"temperature": 0.0, "max_tokens": max_tokens}
    if ignore_eos:
        params["ignore_eos"] = True
    if a.llm_worker == "ar":
        worker = {"worker_type": "ar", "scheduler_cls": "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
                  "async_scheduling": False}
    else:  # vLLM's own worker and scheduler for the stage: a plain LLM (see --llm-worker)
        worker = {"worker_cls": "auto"}
    return {
        "stage_id": 0, "stage_type": "llm", "is_comprehension": True,
        "runtime": {"process": True, "devices": "0"},
        "engine_args": {
            "model": model, "model_stage": "llm", **worker,
            "engine_output_type": "text", "enforce_eager": True, "max_model_len": a.max_model_len,
            "gpu_memory_utilization": a.gpu_memory_utilization, "kv_cache_memory_bytes": a.kv_cache_bytes,
            "skip_mm_profiling": True},
        "final_output": final, "final_output_type": "text", "default_sampling_params": params,
    }


def write_configs(a, work: Path, llm: str, sd: str) -> dict:
    text = {"stage_args": [llm_stage(a, llm, True, 32, False)]}
    image = {"stage_args": [
        llm_stage(a, llm, False, a.image_llm_tokens, True),
        {"stage_id": 1, "stage_type": "diffusion", "runtime": {"process": True, "devices": "0"},
         "engine_input_source": [0],
         "custom_process_input_func": "benchmarks.gpu.omni_stage_input.llm_text_as_prompt",
         "engine_args": {"model": sd, "model_stage": "dit", "diffusion_load_format": "diffusers",
                         "dtype": "float32", "max_num_seqs": 1},
         "final_output": True, "final_output_type": "image",
         "default_sampling_params": {"num_inference_steps": a.steps, "guidance_scale": 3.0,
                                     "height": a.default_size, "width": a.default_size, "seed": 0}},
    ]}
    paths = {}
    for name, doc in (("text", text), ("image", image)):
        path = work / f"omni_{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths[name] = str(path)
    # Turbine's own reading of them (the worker refuses a bad file before anything starts).
    from turbine.vllm.omni_config import read_stage_configs

    return {name: {"path": p, "output_modalities": list(read_stage_configs(p).output_modalities)}
            for name, p in paths.items()}


# --------------------------------------------------------------------------- processes
def env_for(a, omni: bool) -> dict:
    """vLLM-Omni's site only for the processes that run it: its vLLM plugin patches vLLM in any process that can
    import it, and the plain worker is the reference."""
    sites = ([a.omni_site] if omni else []) + [a.site, str(REPO_ROOT)]
    return {"PYTHONPATH": ":".join(s for s in sites if s), "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def engine_flags(a) -> list[str]:
    return ["--enforce-eager", "--max-model-len", str(a.max_model_len), "--gpu-memory-utilization",
            str(a.gpu_memory_utilization), "--kv-cache-memory-bytes", str(a.kv_cache_bytes)]


def served(port: int, names: list[str]) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            have = {m.get("id") for m in json.loads(r.read()).get("data", [])}
        return all(n in have for n in names)
    except Exception:
        return False


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """The sum of a family's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class Checks:
    """PASS / FAIL per check; an exception is a FAIL with its full traceback, and the run goes on."""

    def __init__(self, doc: dict, section: str):
        self.results = doc.setdefault(section, {})

    def run(self, name: str, fn, *args):
        t0 = time.monotonic()
        try:
            detail = fn(*args) or {}
            ok = bool(detail.pop("ok", True))
            self.results[name] = {"pass": ok, "seconds": round(time.monotonic() - t0, 1), **detail}
            print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail.get('why', '')}"), flush=True)
            return detail if ok else None
        except Exception as exc:
            tb = traceback.format_exc()
            print(f"FAIL {name}: {type(exc).__name__}: {exc}\n{tb}", flush=True)
            self.results[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
            return None


# --------------------------------------------------------------------------- phase text
def phase_text(a, doc: dict, procs, configs: dict) -> None:
    from openai import OpenAI

    checks = Checks(doc, "text")
    disc = tempfile.mkdtemp(prefix="discovery_", dir=procs.run_dir)
    port = free_port_()
    base = {"TURBINE_DISCOVERY_BACKEND": "file", "TURBINE_DISCOVERY_DIR": disc}
    procs.spawn("text_plain_worker", [sys.executable, "-m", "turbine.vllm", "--model", a.llm, "--served-model-name",
                                      PLAIN, *engine_flags(a)], {**env_for(a, False), **base})
    procs.spawn("text_omni_worker", [sys.executable, "-m", "turbine.vllm", "--model", a.llm, "--served-model-name",
                                     OMNI_TEXT, "--omni", "--stage-configs-path", configs["text"]["path"]],
                {**env_for(a, True), **base})
    procs.spawn("text_frontend", [sys.executable, "-m", "turbine.frontend", "--http-port", str(port)],
                {**env_for(a, False), **base})
    if not checks.run("text_workers_start", lambda: {
            "start_s": round(procs.wait(lambda: served(port, [PLAIN, OMNI_TEXT]), a.start_timeout, "workers"), 1)}):
        return
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

    def chat(model, prompt, stream):
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32)
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                                             "total_tokens"})
        text, usage = "", None
        for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
        return text, usage

    def completion(model, prompt):
        r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=32)
        return r.choices[0].text, r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})

    def parity(kind):
        pairs = []
        for p in COMPLETION_PROMPTS if kind == "completions" else PROMPTS:
            if kind == "completions":
                plain, omni = completion(PLAIN, p), completion(OMNI_TEXT, p)
            else:
                plain, omni = chat(PLAIN, p, kind == "chat_stream"), chat(OMNI_TEXT, p, kind == "chat_stream")
            pairs.append({"prompt": p, "plain": plain[0], "omni": omni[0], "plain_usage": plain[1],
                          "omni_usage": omni[1]})
        texts_equal = all(x["plain"] == x["omni"] and x["plain"] for x in pairs)
        usage_right = all(x["omni_usage"] and x["omni_usage"] == x["plain_usage"] and x["omni_usage"]["total_tokens"]
                          == x["omni_usage"]["prompt_tokens"] + x["omni_usage"]["completion_tokens"] for x in pairs)
        why = [] if texts_equal else ["texts differ"]
        why += [] if usage_right else ["usage differs or is missing"]
        return {"ok": texts_equal and usage_right, "why": ", ".join(why), "pairs": pairs}

    for kind in ("chat", "chat_stream", "completions"):
        checks.run(f"greedy_parity_{kind}", parity, kind)

    def stream_equals_whole():
        whole = [chat(OMNI_TEXT, p, False) for p in PROMPTS]
        streamed = [chat(OMNI_TEXT, p, True) for p in PROMPTS]
        return {"ok": whole == streamed, "why": "the streamed text or usage is not the whole answer's"}

    checks.run("omni_stream_equals_whole", stream_equals_whole)


# --------------------------------------------------------------------------- phase image
def png_size(b64: str) -> tuple[tuple[int, int], bytes]:
    from PIL import Image

    raw = base64.b64decode(b64)
    with Image.open(io.BytesIO(raw)) as im:
        im.load()
        if im.format != "PNG":
            raise ValueError(f"not a PNG: {im.format}")
        return im.size, im.tobytes()


def phase_image(a, doc: dict, procs, configs: dict) -> None:
    from openai import OpenAI

    checks = Checks(doc, "image")
    disc = tempfile.mkdtemp(prefix="discovery_", dir=procs.run_dir)
    port, worker_metrics = free_port_(), free_port_()
    base = {"TURBINE_DISCOVERY_BACKEND": "file", "TURBINE_DISCOVERY_DIR": disc}
    procs.spawn("image_omni_worker", [sys.executable, "-m", "turbine.vllm", "--model", a.llm, "--served-model-name",
                                      OMNI_IMAGE, "--omni", "--stage-configs-path", configs["image"]["path"],
                                      "--system-port", str(worker_metrics)], {**env_for(a, True), **base})
    procs.spawn("image_frontend", [sys.executable, "-m", "turbine.frontend", "--http-port", str(port)],
                {**env_for(a, False), **base})
    # AsyncOmni called directly, in one process of its own, started beside (it waits for rounds on stdin).
    results = procs.run_dir / "image_direct_asyncomni.jsonl"
    results.unlink(missing_ok=True)
    direct = procs.spawn("image_direct_asyncomni", [
        sys.executable, "-m", "benchmarks.gpu.gpu_omni", "direct", "--model", a.llm, "--config",
        configs["image"]["path"], "--size", str(a.timing_size), "--results", str(results)], env_for(a, True),
        stdin=subprocess.PIPE)
    if not checks.run("image_worker_starts", lambda: {
            "start_s": round(procs.wait(lambda: served(port, [OMNI_IMAGE]), a.start_timeout, "omni image worker"),
                             1)}):
        return
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    size = f"{a.image_size}x{a.image_size}"

    def generate(n=1, seed=7, size_=size, timeout=None):
        c = client if timeout is None else client.with_options(timeout=timeout)
        r = c.images.generate(model=OMNI_IMAGE, prompt=IMAGE_PROMPT, n=n, size=size_, response_format="b64_json",
                              extra_body={"seed": seed})
        return [png_size(d.b64_json) for d in r.data]

    def images_generations():
        t0 = time.monotonic()
        got = generate(n=2)
        sizes = [s for s, _ in got]
        want = (a.image_size, a.image_size)
        return {"ok": sizes == [want, want], "why": f"sizes {sizes}, asked {want} twice", "sizes": sizes,
                "seconds_n2": round(time.monotonic() - t0, 3)}

    def chat_image():
        raw = client.chat.completions.with_raw_response.create(
            model=OMNI_IMAGE, messages=[{"role": "user", "content": IMAGE_PROMPT}], seed=7)
        body = json.loads(raw.text)
        parts = body["choices"][0]["message"]["content"]
        urls = [p["image_url"]["url"] for p in parts if p.get("type") == "image_url"]
        sizes = [png_size(u.split(",", 1)[1])[0] for u in urls if u.startswith("data:image/png;base64,")]
        want = (a.default_size, a.default_size)  # the pipeline's default (a chat asks no size)
        return {"ok": sizes == [want], "why": f"sizes {sizes}, the pipeline's default {want}", "sizes": sizes}

    def same_seed():
        first, second, other = generate(seed=11), generate(seed=11), generate(seed=12)
        a_px, b_px = first[0][1], second[0][1]
        max_diff = max((abs(x - y) for x, y in zip(a_px, b_px)), default=0) if len(a_px) == len(b_px) else None
        return {"ok": a_px == b_px, "why": f"two requests with seed 11: max pixel difference {max_diff}", "max_pixel_difference": max_diff, "other_seed_differs": a_px != other[0][1]}

    checks.run("images_generations_pngs_at_size", images_generations)
    checks.run("chat_image_png_at_default_size", chat_image)
    checks.run("same_seed_same_image", same_seed)

    def stage_totals():
        text = scrape(worker_metrics)
        return {s: (metric(text, "turbine_worker_omni_stage_seconds_sum", stage=s),
                    metric(text, "turbine_worker_omni_stage_seconds_count", stage=s)) for s in ("0", "1")}

    def cancel():
        big = f"{a.cancel_size}x{a.cancel_size}"
        before = stage_totals()
        t0 = time.monotonic()
        generate(size_=big)
        full = time.monotonic() - t0
        after = stage_totals()
        stage0 = after["0"][0] - before["0"][0]
        # 40% into the request: past the frontend, into the pipeline (stage 0, or stage 1 on a fast stage 0).
        cut = max(0.25, 0.4 * full)
        m0 = scrape(worker_metrics)
        t0 = time.monotonic()
        try:
            generate(size_=big, timeout=cut)
            return {"ok": False, "why": f"the request finished within {cut:.2f}s: nothing to cancel (raise "
                    "--cancel-size or --image-llm-tokens)", "full_request_s": round(full, 3)}
        except Exception as exc:  # the client gives up: the frontend sees the disconnect and cancels
            left = f"{type(exc).__name__}"
        time.sleep(3.0)
        m1 = scrape(worker_metrics)
        inflight = metric(m1, "turbine_worker_inflight_requests", model=OMNI_IMAGE)
        cancelled = (metric(m1, "turbine_worker_cancellations_total", model=OMNI_IMAGE)
                     - metric(m0, "turbine_worker_cancellations_total", model=OMNI_IMAGE))
        t1 = time.monotonic()
        generate(size_=big)
        follow = time.monotonic() - t1
        ok = inflight == 0 and cancelled >= 1
        return {"ok": ok, "why": f"in flight after 3 s: {inflight}, cancellations counted: {cancelled}",
                "full_request_s": round(full, 3), "stage0_s": round(stage0, 3), "cancelled_after_s": round(cut, 3),
                "client_saw": left, "inflight_after_3s": inflight, "cancellations": cancelled,
                "next_request_s": round(follow, 3)}

    checks.run("cancel_mid_pipeline_frees_the_engine", cancel)

    def timing():
        procs.wait(lambda: results.exists() and '"ready"' in results.read_text(), a.start_timeout,
                   "direct AsyncOmni")
        tsize = f"{a.timing_size}x{a.timing_size}"
        generate(size_=tsize)  # warm-up of Turbine's path (the direct process warms its own)
        turbine_e2e, direct_e2e, direct_png, direct_stages = [], [], [], {"0": [], "1": []}
        turbine_stage = {"0": [0.0, 0.0], "1": [0.0, 0.0]}
        order = []
        for r in range(a.rounds):
            first = "turbine" if r % 2 == 0 else "direct"
            order.append(first)
            for who in (first, "direct" if first == "turbine" else "turbine"):
                if who == "turbine":
                    before = stage_totals()
                    for i in range(a.repeats):
                        t0 = time.perf_counter()
                        generate(size_=tsize, seed=100 + i)
                        turbine_e2e.append(time.perf_counter() - t0)
                    after = stage_totals()
                    for s in ("0", "1"):
                        turbine_stage[s][0] += after[s][0] - before[s][0]
                        turbine_stage[s][1] += after[s][1] - before[s][1]
                else:
                    res = direct_round(direct, results, a.repeats)
                    direct_e2e += res["e2e_s"]
                    direct_png += res.get("png_s", [])
                    for s, vals in res["stages_s"].items():
                        direct_stages.setdefault(s, []).extend(vals)
        med_t, med_d = statistics.median(turbine_e2e), statistics.median(direct_e2e)
        stages = {}
        for s in ("0", "1"):
            t_mean = turbine_stage[s][0] / turbine_stage[s][1] if turbine_stage[s][1] else None
            d_vals = direct_stages.get(s) or []
            d_mean = statistics.mean(d_vals) if d_vals else None
            stages[s] = {"turbine_mean_s": t_mean, "direct_mean_s": d_mean,
                         "direct_median_s": statistics.median(d_vals) if d_vals else None,
                         "ratio_direct_over_turbine": (d_mean / t_mean) if t_mean and d_mean else None}
        ratio = med_d / med_t
        stage_ok = all(v["ratio_direct_over_turbine"] is not None and v["ratio_direct_over_turbine"] >= 0.95
                       for v in stages.values())
        stage_ratios = {s: v["ratio_direct_over_turbine"] for s, v in stages.items()}
        return {"ok": ratio >= 0.95 and stage_ok, "why": f"e2e direct/turbine {ratio:.3f}; per stage {stage_ratios}",
                "size": tsize, "rounds": a.rounds, "repeats": a.repeats, "first_each_round": order,
                "e2e": {"turbine_median_s": med_t, "direct_median_s": med_d, "ratio_direct_over_turbine": ratio,
                        "turbine_s": turbine_e2e, "direct_s": direct_e2e,
                        "png_encode_median_s": statistics.median(direct_png) if direct_png else None},
                "stages": stages}

    checks.run("timing_turbine_vs_direct_asyncomni", timing)
    if direct.poll() is None:
        direct.stdin.write("quit\n")
        direct.stdin.flush()


def direct_round(direct, path: Path, n: int) -> dict:
    """One round of the direct process: n requests; its answer is the next JSON line of its results file."""
    seen = len(path.read_text().splitlines())
    direct.stdin.write(json.dumps({"n": n}) + "\n")
    direct.stdin.flush()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if direct.poll() is not None:
            raise RuntimeError(f"the direct AsyncOmni process exited ({direct.returncode})")
        lines = path.read_text().splitlines()
        if len(lines) > seen:
            res = json.loads(lines[seen])
            if "error" in res:
                raise RuntimeError(f"direct AsyncOmni: {res['error']}")
            return res
        time.sleep(0.2)
    raise TimeoutError("the direct AsyncOmni round did not answer in 300 s")


# --------------------------------------------------------------------------- the direct AsyncOmni process
def direct_main(a) -> int:
    """AsyncOmni in this process, as Turbine's handler calls it (the same prompt fields, sampling params and output
    modalities; the images' PNG encoding timed apart, outside e2e): rounds of n requests read from stdin, one JSON
    line each appended to --results."""
    import asyncio

    async def main():
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        from turbine.vllm.omni_worker import output_images, png_bytes, stage_seconds

        omni = AsyncOmni(model=a.model, stage_configs_path=a.config)
        defaults = omni.default_sampling_params_list

        def params(seed):
            out = []
            for d in defaults:
                if isinstance(d, SamplingParams):
                    p = d.clone()
                    p.output_kind = RequestOutputKind.DELTA
                    out.append(p)
                else:
                    out.append(dataclasses.replace(d, width=a.size, height=a.size, seed=seed,
                                                   num_outputs_per_prompt=1))
            return out

        async def one(i, seed):
            last = None
            async for out in omni.generate({"prompt": IMAGE_PROMPT, "modalities": ["image"]},
                                           request_id=f"direct-{i}", sampling_params_list=params(seed),
                                           output_modalities=["image"]):
                last = out
            if last is None or not output_images(last):
                raise RuntimeError("no image")
            return last

        def answer(doc):  # vLLM logs on stdout: the answers go to a file of their own
            with open(a.results, "a") as f:
                f.write(json.dumps(doc) + "\n")

        await one(-1, 1)  # warm-up
        answer({"ready": True})
        count = 0
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).strip()
            if not line or line == "quit":
                break
            n = json.loads(line)["n"]
            e2e, stages, png = [], {}, []
            try:
                for i in range(n):
                    t0 = time.perf_counter()
                    last = await one(count, 100 + i)
                    e2e.append(time.perf_counter() - t0)
                    count += 1
                    for s, v in stage_seconds(last).items():
                        stages.setdefault(s, []).append(v)
                    t0 = time.perf_counter()  # what Turbine adds per image, timed apart (not in e2e_s)
                    [png_bytes(im) for im in output_images(last)]
                    png.append(time.perf_counter() - t0)
                answer({"e2e_s": e2e, "stages_s": stages, "png_s": png})
            except Exception as exc:
                answer({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        omni.shutdown()

    asyncio.run(main())
    return 0


# --------------------------------------------------------------------------- plumbing
def free_port_() -> int:
    from turbine.runtime.ports import free_port

    return free_port()


def machine() -> dict:
    return gpu_machine(("vllm", "vllm-omni", "torch", "transformers", "diffusers"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_omni", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=("text", "image", "all"), default="all")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/gpu-out"), "gpu_omni.json"),
                   help="the JSON result (updated: a later phase adds its section)")
    p.add_argument("--logs", help="every process's log (default: omni-logs beside --out)")
    p.add_argument("--work", default="/tmp/omni-proof", help="the tiny diffusion model and the stage configs")
    p.add_argument("--llm", default=str(H8 / "smollm2"), help="the LLM stage's and the plain worker's model")
    p.add_argument("--site", default=str(H8 / "site"), help="vLLM 0.26.0's site (gpu_install.sh install)")
    p.add_argument("--omni-site", default=str(H8 / "omni-site"), help="vLLM-Omni's site (install-omni)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30,
                   help="each LLM engine's KV cache (fixed: engines start side by side on one GPU)")
    p.add_argument("--llm-worker", choices=("ar", "auto"), default="auto",
                   help="the LLM stages' worker: vLLM's own (worker_cls auto), or vLLM-Omni's AR worker and scheduler "
                        "(as its deploy configs give an llm_ar stage), which runs only vLLM-Omni's own models: with a "
                        "plain Llama it failed the first step on an H200 (\"LlamaForCausalLM.forward() got an unexpected "
                        "keyword argument 'sampling_metadata'\", 2026-11-29)")
    p.add_argument("--steps", type=int, default=50, help="the diffusion stage's inference steps")
    p.add_argument("--image-llm-tokens", type=int, default=64,
                   help="tokens the image pipeline's LLM stage writes (ignore_eos) for the diffusion prompt")
    p.add_argument("--default-size", type=int, default=128, help="the diffusion stage's default image side")
    p.add_argument("--image-size", type=int, default=192, help="the side /v1/images/generations asks for")
    p.add_argument("--cancel-size", type=int, default=1024, help="the side of the request cancelled mid-pipeline")
    p.add_argument("--timing-size", type=int, default=256,
                   help="the side of the timed requests (the PNG Turbine encodes grows with it; the tiny model's "
                        "steps hardly do)")
    p.add_argument("--rounds", type=int, default=4, help="timing rounds, the first system alternating")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per system per round")
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--dry-run", action="store_true",
                   help="build the tiny model, write the configs and the JSON; start nothing (CPU is enough)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["direct"]:
        d = argparse.ArgumentParser(prog="gpu_omni direct")
        d.add_argument("--model", required=True)
        d.add_argument("--config", required=True)
        d.add_argument("--size", type=int, required=True)
        d.add_argument("--results", required=True)
        return direct_main(d.parse_args(argv[1:]))
    a = parser().parse_args(argv)
    # A `timeout` (gpu_tests.sh's STEP_TIMEOUT) must still write the checks so far and stop the servers.
    exit_on_sigterm()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(a.logs) if a.logs else out.parent / "omni-logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.update({"issue": "35 §2", "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine()})
    doc.setdefault("runs", []).append({"argv": argv, "phase": a.phase, "dry_run": a.dry_run})
    setup = Checks(doc, "setup")
    model = setup.run("tiny_diffusion_model_built", lambda: build_tiny_sd(work / "tiny-sd"))
    if a.dry_run:
        setup.run("tiny_diffusion_model_runs_in_diffusers", lambda: smoke_tiny_sd(work / "tiny-sd"))
    configs = setup.run("stage_configs_written", write_configs, a, work, a.llm, str(work / "tiny-sd"))
    procs = Procs(logs)
    try:
        if not a.dry_run and configs is not None:
            if a.phase in ("text", "all"):
                phase_text(a, doc, procs, configs)
                procs.stop()
            if a.phase in ("image", "all") and model is not None:
                phase_image(a, doc, procs, configs)
    finally:
        procs.stop()
        out.write_text(json.dumps(doc, indent=2, default=str))
    failed = [f"{sec}.{name}" for sec in ("setup", "text", "image") for name, r in doc.get(sec, {}).items()
              if not r.get("pass")]
    log(f"wrote {out}; logs in {logs}; " + (f"FAILED: {', '.join(failed)}" if failed else "every check passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

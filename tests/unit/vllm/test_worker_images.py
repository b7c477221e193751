"""The vLLM worker's side of images (GenerateRequest.images): --enable-multimodal and the flags for what is not
built another way refused by name, the images decoded with Pillow into the engine's multi-modal data with their
hashes as identifiers, refused without the flag (the real engine:
tests/integration/test_multimodal_model.py)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from PIL import Image

from turbine.protocol.generate import GenerateRequest, ImageInput
from turbine.runtime.errors import InvalidRequest
from turbine.vllm.args import parse_worker_args
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.vllm.images import decode_images, multimodal_prompt
from turbine.worker.worker_metrics import WorkerMetrics


def png(color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 10), color).save(buf, format=fmt)
    return buf.getvalue()


def test_enable_multimodal_reaches_the_config():
    assert parse_worker_args(["--enable-multimodal"]).enable_multimodal
    assert not parse_worker_args([]).enable_multimodal


@pytest.mark.parametrize("argv, words", [
    (["--enable-multimodal", "--use-vllm-tokenizer"], "token mode"),
    (["--ec-transfer-config", '{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}'],
     "--ec-transfer-config is not supported"),
    (["--mm-encoder-only"], "--mm-encoder-only is not supported"),
    (["--enable-mm-embeds"], "--enable-mm-embeds is not supported"),
])
def test_what_is_not_built_is_refused_by_name(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_images_become_the_engines_multimodal_data_with_their_hashes():
    items = [ImageInput(data=png(), hash="a" * 64), ImageInput(data=png((0, 0, 255), "JPEG"), hash="b" * 64)]
    prompt = multimodal_prompt([1, 2, 3], items)
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    images = prompt["multi_modal_data"]["image"]
    assert [im.mode for im in images] == ["RGB", "RGB"] and images[0].size == (12, 10)
    assert prompt["multi_modal_uuids"] == {"image": ["a" * 64, "b" * 64]}


@pytest.mark.parametrize("data, words", [
    (b"not an image", "cannot be decoded"), (png()[:40], "cannot be decoded"), (png(fmt="GIF"), "format GIF")])
def test_bad_image_bytes_are_invalid_requests(data, words):
    with pytest.raises(InvalidRequest, match=words):
        decode_images([ImageInput(data=data, hash="h")])


class Engine:
    def __init__(self):
        model_config = SimpleNamespace(max_model_len=64, get_diff_sampling_param=lambda: {},
                                       enable_prompt_embeds=False)
        self.vllm_config = SimpleNamespace(model_config=model_config)
        self.prompts = []

    async def generate(self, prompt, params, request_id, *, lora_request=None, data_parallel_rank=None):
        self.prompts.append(prompt)
        comp = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
        # The engine's prompt: the image token widened to the image's placeholder tokens.
        yield SimpleNamespace(outputs=[comp], finished=True, num_cached_tokens=0, kv_transfer_params=None,
                              prompt_token_ids=[1] * 20)

    async def abort(self, request_id):
        pass


def handlers(role: str, multimodal: bool):
    engine = Engine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m", "worker_id": f"mm-{role}-{multimodal}"})
    return HANDLERS_OF_ROLE[role](engine, metrics, multimodal=multimodal), engine


def request() -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[1, 2, 3],
                           images=[ImageInput(data=png(), hash="c" * 64)])


async def test_the_engine_gets_the_images_and_usage_counts_its_widened_prompt():
    h, engine = handlers("agg", True)
    [out] = [o async for o in h.generate(request(), None)]
    assert engine.prompts[0]["multi_modal_uuids"] == {"image": ["c" * 64]}
    assert out.usage.prompt_tokens == 20


@pytest.mark.parametrize("role, multimodal, words", [("agg", False, "--enable-multimodal"),
                                                     ("prefill", False, "--enable-multimodal")])
async def test_workers_that_take_no_images_refuse_them(role, multimodal, words):
    h, engine = handlers(role, multimodal)
    with pytest.raises(InvalidRequest, match=words):
        [o async for o in h.generate(request(), None)]
    assert not engine.prompts


def test_pixels_from_the_frontend_are_wrapped_not_decoded():
    from turbine.protocol.generate import ImagePixels

    raw = bytes(range(256)) * 3  # 16 x 16 x 3
    (image,) = decode_images([ImageInput(hash="h", pixels=ImagePixels(dtype="uint8", shape=[16, 16, 3], data=raw))])
    assert image.mode == "RGB" and image.size == (16, 16) and image.tobytes() == raw


@pytest.mark.parametrize("item, words", [
    (dict(pixels=dict(dtype="float32", shape=[16, 16, 3])), "expected dtype uint8"),
    (dict(pixels=dict(dtype="uint8", shape=[16, 16])), "expected dtype uint8 and shape"),
    (dict(pixels=dict(dtype="uint8", shape=[16, 17, 3])), "bytes for shape"),
    (dict(pixels=dict(dtype="uint8", shape=[1 << 14, 1 << 13, 3])), "too large"),
    (dict(pixels=dict(dtype="uint8", shape=[16, 16, 3]), data=b"png"), "not both"),
])
def test_bad_pixels_are_invalid_requests(item, words):
    from turbine.protocol.generate import ImagePixels

    pixels = ImagePixels(data=bytes(range(256)) * 3, **item.pop("pixels"))
    with pytest.raises(InvalidRequest, match=words):
        decode_images([ImageInput(hash="h", pixels=pixels, **item)])


async def test_images_are_counted_by_form():
    from prometheus_client import REGISTRY

    from turbine.protocol.generate import ImagePixels

    def count(form):
        return REGISTRY.get_sample_value("turbine_worker_images_total", {
            "namespace": "t", "component": "c", "model": "m", "worker_id": "mm-agg-True", "form": form}) or 0

    h, engine = handlers("agg", True)
    pixels = ImageInput(hash="d" * 64, pixels=ImagePixels(dtype="uint8", shape=[2, 2, 3], data=bytes(12)))
    req = GenerateRequest(request_id="r", model="m", token_ids=[1, 2, 3], images=[request().images[0], pixels])
    files, decoded = count("file"), count("pixels")
    [_ async for _ in h.generate(req, None)]
    assert count("file") - files == 1 and count("pixels") - decoded == 1
    assert engine.prompts[-1]["multi_modal_data"]["image"][1].size == (2, 2)


async def test_max_tokens_counts_the_engines_widened_prompt():
    from turbine.protocol.generate import StopConditions

    h, engine = handlers("agg", True)
    # The engine widens the image token to the measured placeholder (10 tokens here): 3 + 9 = 12 tokens of the
    # context of 64; max_tokens 53 would end at the context length, so it is refused as for a text prompt.
    h.image_placeholder = ([9] * 10, (0, 10))
    req = request()
    req.stop = StopConditions(max_tokens=53)
    with pytest.raises(InvalidRequest, match="the prompt has 12 tokens and max_tokens is 53"):
        [_ async for _ in h.generate(req, None)]
    req.stop = StopConditions(max_tokens=52)
    [_ async for _ in h.generate(req, None)]

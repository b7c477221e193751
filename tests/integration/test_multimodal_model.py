"""Images in chats end to end (issue #19, aggregated): the test vision-language model (tests/multimodal_model.py)
served by TWO real vLLM CPU workers started with --enable-multimodal (two: a repeated image and prefix must land
on the worker that holds it, through the KV router fed by the workers' KV events), a frontend and a second one
with --frontend-decoding (same greedy tokens from pixels decoded in the frontend), and the official openai client.
The same picture gives the same greedy tokens (alone and in a concurrent batch), another picture other tokens;
bad media each get a 400 naming the problem while the server keeps serving; a model whose workers lack
--enable-multimodal (a mocker beside it) refuses images by naming the flag. `/v1/responses` input_image parts
give the chat answer and the same refusals, named by their input item. The bad-media cases in full (size,
format, redirects, timeouts, private addresses) are tests/unit/frontend/preprocess/test_media.py, without an engine.
Run it under the engine lock (flock /tmp/turbine-engine.lock)."""

from __future__ import annotations

import base64
import hashlib
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT
from tests.integration.procs import (
    base_env,
    instances_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.multimodal_model import IMAGE_SEQ_LEN, build_vlm

VLM = "tiny-vlm"
TEXT_ONLY = "text-only-mock"
MAX_TOKENS = 12
BLOCK = 32  # the workers' KV block size (vLLM's CPU default, 128, would leave a one-picture chat no full block)
PICTURES = {"red": ((200, 30, 30), (48, 40)), "blue": ((20, 40, 220), (48, 40)), "green": ((30, 200, 30), (20, 60))}


def picture(color: tuple[int, int, int], size: tuple[int, int], fmt: str = "PNG") -> bytes:
    """A solid picture with stripes of the inverse color every 6 columns, as a file."""
    from PIL import Image

    image = Image.new("RGB", size, color)
    inverse = tuple(255 - c for c in color)
    for x in range(0, size[0], 6):
        for y in range(size[1]):
            image.putpixel((x, y), inverse)
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe the picture."}]}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, model_dir) -> str:
    return str(build_vlm(tmp_path_factory.mktemp("vlm") / "model", text_model_dir=model_dir))


@pytest.fixture(scope="module")
def vlm_cluster(tmp_path_factory, vlm_dir):
    """One multimodal vLLM worker, a mocker serving a text-only model, one frontend (private discovery)."""
    from tests.integration.procs import _start

    root = tmp_path_factory.mktemp("vlm-cluster")
    env = base_env(str(root / "discovery"))

    def vlm_worker(name: str) -> Proc:
        # Not procs.start_worker: its engine flags are the text model's (2048-token context, 16 sequences).
        return _start(name, env, root, "turbine.vllm", "--system-port", "--model", vlm_dir,
                      "--served-model-name", VLM, "--enable-multimodal", "--enforce-eager", "--dtype", "float32",
                      "--max-model-len", "512", "--max-num-seqs", "4", "--limit-mm-per-prompt", '{"image": 2}',
                      "--block-size", str(BLOCK))

    workers = [vlm_worker("worker-a"), vlm_worker("worker-b")]
    mocker = start_mocker("mocker", env, root, "--served-model-name", TEXT_ONLY, "--speedup-ratio", "0")
    # KV routing: image requests are routed on block hashes keyed by their images (router/hashing.py).
    # (--max-images-per-request: above the worker's limit of 2, so each refusal is told apart by its flag)
    frontend = start_frontend("frontend", env, root, "--router-mode", "kv", "--max-images-per-request", "3")
    decoding = start_frontend("frontend-decoding", env, root, "--router-mode", "kv", "--frontend-decoding")
    procs = [*workers, mocker, frontend, decoding]
    try:
        wait_until(lambda: all(worker_ready(w) for w in (*workers, mocker)), ENGINE_START_TIMEOUT,
                   "workers ready", procs)
        wait_until(lambda: all(instances_of(f, VLM) == 2 and instances_of(f, TEXT_ONLY) == 1
                               for f in (frontend, decoding)), 30, "frontends see both models", procs)
        yield {"frontend": frontend, "workers": workers, "decoding": decoding}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def oai(vlm_cluster) -> OpenAI:
    return OpenAI(base_url=f"{vlm_cluster['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=300)


def answer(oai: OpenAI, url: str, model: str = VLM):
    return oai.chat.completions.create(model=model, messages=chat(url), max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True)


def tokens(response) -> list[str]:
    return [t.token for t in response.choices[0].logprobs.content]


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, vlm_dir, model_dir):
    again = build_vlm(tmp_path / "again", text_model_dir=model_dir)
    other = build_vlm(tmp_path / "other", text_model_dir=model_dir, seed=1)
    weights = Path(vlm_dir) / "model.safetensors"
    assert _digest(again / "model.safetensors") == _digest(weights)
    assert _digest(other / "model.safetensors") != _digest(weights)


def test_same_picture_same_tokens_other_picture_other_tokens(oai):
    urls = {name: data_url(picture(*spec)) for name, spec in PICTURES.items()}
    # One concurrent batch (the engine batches them), then the red picture alone.
    with ThreadPoolExecutor(4) as pool:
        batch = list(pool.map(lambda name: answer(oai, urls[name]), ["red", "blue", "green", "red"]))
    alone = answer(oai, urls["red"])
    red, blue, green, red_again = (tokens(r) for r in batch)
    assert red and red == red_again == tokens(alone)
    assert red != blue and red != green and blue != green
    # The engine's prompt: each image token widened to the picture's placeholder (16 tokens and 3 tags), which
    # the usage reports (the frontend's own count has one image token).
    assert alone.usage.prompt_tokens == 53
    assert alone.usage.completion_tokens == len(red) == MAX_TOKENS
    assert IMAGE_SEQ_LEN == 16
    # The same picture as a JPEG is another image (other pixels): served too.
    jpeg = answer(oai, data_url(picture(*PICTURES["red"], fmt="JPEG"), "image/jpeg"))
    assert tokens(jpeg)


@pytest.mark.parametrize("url, named", [
    ("data:image/png;base64,iVBORw0KGgo!!!notbase64", "not valid base64"),
    (data_url(b"GIF89a" + bytes(40), "image/gif"), "supported format"),
    ("http://127.0.0.1:1/picture.png", "loopback address"),
    ("http://10.0.0.7/picture.png", "private or non-global address"),
    ("file:///etc/passwd", "unsupported URL"),
])
def test_bad_media_gets_400_naming_the_problem_and_the_server_keeps_serving(oai, url, named):
    with pytest.raises(openai.BadRequestError) as err:
        answer(oai, url)
    assert named in err.value.message and "messages[0].content[0].image_url" in err.value.message
    assert err.value.body["param"] == "messages"
    still = oai.chat.completions.create(model=VLM, messages=chat(data_url(picture(*PICTURES["blue"]))), max_tokens=1)
    assert still.choices[0].message.content is not None


def test_image_tokens_must_match_the_images(oai):
    # The text spells the image token: the engine would get two image places for one image.
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(picture(*PICTURES["red"]))}},
            {"type": "text", "text": "and <image> too"}]}])
    assert "2 image tokens for 1 images" in err.value.message


def test_more_images_than_the_worker_takes_is_a_400(oai):
    # The worker runs with --limit-mm-per-prompt '{"image": 2}': the engine's refusal comes back as a 400.
    url = data_url(picture(*PICTURES["green"]))
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": url}} for _ in range(3)), {"type": "text", "text": "?"}]}])
    assert "image" in err.value.message
    still = oai.chat.completions.create(model=VLM, messages=chat(url), max_tokens=1)
    assert still.choices[0].message.content is not None


def responses_input(*urls: str, detail: str = "auto") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "input_image", "image_url": u, "detail": detail} for u in urls),
                                         {"type": "input_text", "text": "Describe the picture."}]}]


def test_responses_input_image_gives_the_chat_answer(oai):
    url = data_url(picture(*PICTURES["blue"]))
    reply = oai.responses.create(model=VLM, input=responses_input(url), max_output_tokens=MAX_TOKENS, temperature=0)
    assert reply.status == "incomplete" and reply.usage.output_tokens == MAX_TOKENS  # (the length stop)
    assert reply.output_text == answer(oai, url).choices[0].message.content
    assert reply.usage.input_tokens == 53


@pytest.mark.parametrize("kwargs, param, named", [
    ({"urls": ["http://10.0.0.7/picture.png"]}, "input", "input[0].content[0].image_url: refused to fetch"),
    ({"urls": ["data:x"], "detail": "high"}, "input[0].content[0].detail", "'high' is not supported"),
    # The frontend's own bound (--max-images-per-request 3) holds here too.
    ({"urls": [data_url(picture(*PICTURES["red"]))] * 4}, "input", "--max-images-per-request"),
])
def test_responses_bad_images_are_400s_naming_the_input_item(oai, kwargs, param, named):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=VLM, input=responses_input(*kwargs["urls"], detail=kwargs.get("detail", "auto")),
                             max_output_tokens=4)
    assert err.value.body["param"] == param and named in err.value.message, err.value.body


def test_video_and_audio_parts_are_refused_by_name(oai):
    for part, named in [({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "video"),
                        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio")]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=VLM, max_tokens=4, messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}])
        assert named in err.value.message and "not supported" in err.value.message


def test_a_model_without_enable_multimodal_refuses_images_naming_the_flag(oai):
    with pytest.raises(openai.BadRequestError) as err:
        answer(oai, data_url(picture(*PICTURES["red"])), model=TEXT_ONLY)
    assert "--enable-multimodal" in err.value.message
    # Text still goes through the same content-parts path.
    reply = oai.chat.completions.create(model=TEXT_ONLY, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert reply.choices[0].finish_reason


# -- KV routing on the workers' KV events, frontend-side decoding, max_tokens against the widened prompt ---------

def served_by(workers) -> list[float]:
    """Each worker's count of successful generate requests."""
    return [metric_of(w, "turbine_worker_requests_total", 'outcome="success"') for w in workers]


def metric_of(proc, name: str, having: str = "") -> float:
    from tests.integration.procs import http_text

    return sum(float(line.rsplit(" ", 1)[1]) for line in http_text(f"{proc.url}/metrics").splitlines()
               if line.startswith(name) and line[len(name)] in " {" and having in line)


def overlap_after(frontend, ask) -> float:
    """The KV router's overlap ratio (cached share of the prompt's full blocks on the chosen worker) of the one
    routing decision `ask` makes."""
    before = metric_of(frontend, "turbine_router_overlap_ratio_sum")
    ask()
    return metric_of(frontend, "turbine_router_overlap_ratio_sum") - before


def test_a_repeated_image_and_prefix_lands_on_the_worker_that_holds_it(vlm_cluster, oai):
    frontend, workers = vlm_cluster["frontend"], vlm_cluster["workers"]
    text = "Name every color you can see in this striped picture, from the left edge to the right edge. " * 6
    pictures = {name: data_url(picture(color, (40, 32))) for name, color in
                (("orange", (250, 140, 10)), ("purple", (120, 20, 160)))}
    replies = []

    def ask(name: str):
        return lambda: replies.append(oai.chat.completions.create(model=VLM, max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": pictures[name]}},
                                         {"type": "text", "text": text}]}]))

    before, indexed = served_by(workers), metric_of(frontend, "turbine_router_indexed_blocks")
    assert overlap_after(frontend, ask("orange")) == 0
    holder = max(range(2), key=lambda i: served_by(workers)[i] - before[i])
    # The holder's KV events name the prompt's blocks, the image's among them, by the hashes the frontend computes.
    blocks = replies[0].usage.prompt_tokens // BLOCK
    assert blocks >= 4
    wait_until(lambda: metric_of(frontend, "turbine_router_indexed_blocks") >= indexed + blocks, 30,
               "the first request's blocks indexed from the worker's KV events")
    # So the repeats match their whole prompt there (image blocks and the text after them), and go there.
    for _ in range(3):
        assert overlap_after(frontend, ask("orange")) == 1.0
    after = served_by(workers)
    assert after[holder] - before[holder] == 4 and after[1 - holder] == before[1 - holder]
    # Another image behind the same text shares only the blocks before the image (none here): never an alias.
    assert overlap_after(frontend, ask("purple")) == 0


def test_frontend_decoding_sends_pixels_and_gives_the_same_tokens(vlm_cluster, oai):
    decoding = OpenAI(base_url=f"{vlm_cluster['decoding'].url}/v1", api_key="unused", max_retries=0, timeout=300)
    workers = vlm_cluster["workers"]

    def images(form: str) -> float:
        return sum(metric_of(w, "turbine_worker_images_total", f'form="{form}"') for w in workers)

    files, pixels = images("file"), images("pixels")
    for name in ("red", "green"):
        url = data_url(picture(*PICTURES[name]))
        assert tokens(answer(decoding, url)) == tokens(answer(oai, url))
    # The decoding frontend's images reached the workers as pixels, the other's as files.
    assert images("pixels") - pixels == 2 and images("file") - files == 2


def test_max_tokens_over_the_widened_prompt_is_the_400_of_a_text_prompt(oai):
    url = data_url(picture(*PICTURES["blue"]))
    # The frontend's prompt has 35 tokens; the engine's, with the picture's 19 placeholder tokens, 53.
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=VLM, messages=chat(url), max_tokens=512 - 53 + 1)
    assert err.value.body["param"] == "max_tokens"
    assert "the prompt has 53 tokens and max_tokens is 460, 513 in all, over the model's context length of 512" \
        in err.value.message
    text = [{"role": "user", "content": "Describe the picture."}]
    with pytest.raises(openai.BadRequestError) as text_err:
        oai.chat.completions.create(model=VLM, messages=text, max_tokens=512)
    assert text_err.value.body["param"] == "max_tokens" and "over the model's context length of 512" \
        in text_err.value.message
    # What fits is served.
    assert oai.chat.completions.create(model=VLM, messages=chat(url), max_tokens=1).choices[0].finish_reason

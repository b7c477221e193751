"""The frontend's media stage (turbine/frontend/preprocess/media.py) without an engine: image_url parts split out of the
messages, data: URLs and http(s) fetches bounded in bytes, pixels, time and redirects, private and loopback
addresses refused unless the operator allows them, Pillow's verdict on the format, video and audio refused;
and preprocess: images go to the worker as checked bytes with a pixel hash, only to workers with
--enable-multimodal. The engine's side: tests/integration/test_multimodal_model.py."""

from __future__ import annotations

import asyncio
import base64
import io

import msgspec
import pytest

from tests.multimodal_model import CHAT_TEMPLATE
from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.config import ConfigError
from turbine.frontend.apis import responses
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable
from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.frontend.preprocess.media import MediaConfig, address_refusal, check_image, load_image, split_media
from turbine.frontend.preprocess.stage import preprocess
from turbine.protocol.generate import GenerateRequest

WHERE = "messages[0].content[0].image_url"
LOCAL = MediaConfig(allow_private_urls=True, fetch_timeout_s=2.0)


def picture(color=(200, 30, 30), size=(48, 40), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


async def refused(url: str, cfg: MediaConfig = MediaConfig()) -> str:
    with pytest.raises(RequestError) as err:
        await load_image(WHERE, url, cfg)
    assert err.value.param == "messages" and err.value.message.startswith(WHERE)
    return err.value.message


# -- parts -------------------------------------------------------------------------------------------------
def test_image_url_parts_become_image_places_in_order():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:one"}},
                                             {"type": "image_url", "image_url": "https://x/two.png"}]}]
    out, urls = split_media(messages)
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert urls == [("messages[1].content[1].image_url", "data:one"),
                    ("messages[1].content[2].image_url", "https://x/two.png")]


@pytest.mark.parametrize("part, words", [
    ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "(video) are not supported"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "(audio) are not supported"),
    ({"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}, "(audio) are not supported"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "(image embeddings) are not supported"),
    ({"type": "image"}, "send images as image_url parts"),
    ({"type": "image_url", "image_url": {}}, "must be an object with a 'url' string"),
])
def test_parts_it_does_not_take_are_refused_by_name(part, words):
    with pytest.raises(RequestError) as err:
        split_media([{"role": "user", "content": [part]}])
    assert words in err.value.message and "messages[0].content[0]" in err.value.message


# -- data: URLs and Pillow ---------------------------------------------------------------------------------
async def test_a_data_url_gives_the_file_and_a_hash_of_its_pixels():
    png = picture()
    image = await load_image(WHERE, data_url(png), MediaConfig())
    assert image.data == png and len(image.hash) == 64
    # The same pixels in another lossless file (WebP lossless) hash alike; other pixels do not.
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).save(buf, format="WEBP", lossless=True)
    assert (await load_image(WHERE, data_url(buf.getvalue(), "image/webp"), MediaConfig())).hash == image.hash
    assert (await load_image(WHERE, data_url(picture((20, 40, 220))), MediaConfig())).hash != image.hash


async def test_bad_data_urls_are_400s_naming_the_problem():
    assert "not valid base64" in await refused("data:image/png;base64,iVBORw0KGgo!!!")
    assert "must be base64" in await refused("data:image/png,rawbytes")
    assert "is not an image" in await refused("data:text/html;base64," + base64.b64encode(b"<html>").decode())
    assert "is empty" in await refused("data:image/png;base64,")
    assert "over the limit of 100 bytes (--max-image-bytes)" in await refused(data_url(picture()),
                                                                             MediaConfig(max_image_bytes=100))


async def test_pillow_decides_the_format_and_the_pixels_are_bounded_before_decoding():
    assert "unsupported image format GIF" in await refused(data_url(picture(fmt="GIF"), "image/gif"))
    assert "unsupported image format BMP" in await refused(data_url(picture(fmt="BMP")))
    assert "not an image in a supported format" in await refused(data_url(b"\x00" * 64))
    # A truncated PNG: its header says 48x40, its pixels are cut off.
    assert "cannot be decoded" in await refused(data_url(picture()[:60]))
    big = await refused(data_url(picture(size=(300, 200))), MediaConfig(max_image_pixels=10_000))
    assert "300x200 pixels, over the limit of 10000 (--max-image-pixels)" in big
    # The bound holds from the header alone: a 9000x9000 PNG of one color is small as a file.
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(RequestError, match="9000x9000 pixels, over the limit of 16777216"):
        check_image(WHERE, buf.getvalue(), MediaConfig().max_image_pixels)


async def test_unsupported_urls_are_refused():
    for url in ("file:///etc/passwd", "ftp://x/y.png", "gopher://x", "/relative.png", "not a url"):
        assert "unsupported URL" in await refused(url)


# -- http(s) -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ip, why", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("169.254.169.254", "private"), ("100.64.0.1", "private"),
    ("0.0.0.0", "private"), ("224.0.0.1", "private"), ("fe80::1", "private"), ("fc00::1", "private"),
    ("8.8.8.8", None), ("2001:4860:4860::8888", None),
])
def test_only_global_addresses_are_reachable(ip, why):
    refusal = address_refusal(ip)
    assert (refusal is None) if why is None else (why in refusal)


async def test_private_and_loopback_urls_are_refused_before_connecting():
    assert "loopback address (127.0.0.1)" in await refused("http://127.0.0.1:9/a.png")
    assert "--allow-private-media-urls" in await refused("http://localhost:9/a.png")
    assert "private or non-global address (10.0.0.1)" in await refused("https://10.0.0.1/a.png")
    assert "(169.254.169.254)" in await refused("http://169.254.169.254/latest/meta-data/")
    # Spellings of loopback that a string check on the host would miss: the resolved address is checked.
    for url in ("http://0x7f000001/a", "http://2130706433/a", "http://127.1/a", "http://[::ffff:7f00:1]/a",
                "HTTP://127.0.0.1/a"):
        assert "loopback address" in await refused(url)
    # Malformed URLs are 400s too, never the frontend's failure.
    assert "is malformed" in await refused("http://[::1")
    assert "failed: ValueError" in await refused("http://127.0.0.1:99999/a")


class Server:
    """A local HTTP server whose answers the test scripts: path -> (status, headers, body) or "hang"."""

    def __init__(self, routes):
        self.routes = routes
        self.server = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        try:
            line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            route = self.routes[line.split()[1].decode()]
            if route == "hang":
                await asyncio.sleep(30)
                return
            status, headers, body = route
            head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(head.encode() + b"\r\n" + body)
            await writer.drain()
        finally:
            writer.close()


async def test_fetching_with_the_operators_allowance_redirects_and_limits():
    png = picture()
    routes = {"/a.png": (200, {}, png), "/moved": (302, {"Location": "/a.png"}, b""),
              "/loop": (302, {"Location": "/loop"}, b""), "/missing": (404, {}, b"no"),
              "/huge": (200, {}, png * 40), "/slow": "hang", "/text": (200, {}, b"hello"),
              "/to-file": (302, {"Location": "file:///etc/passwd"}, b"")}
    async with Server(routes) as s:
        assert (await load_image(WHERE, f"{s.url}/a.png", LOCAL)).data == png
        assert (await load_image(WHERE, f"{s.url}/moved", LOCAL)).data == png
        assert "more than 3 redirects (--media-max-redirects)" in await refused(f"{s.url}/loop", LOCAL)
        assert "answered HTTP 404" in await refused(f"{s.url}/missing", LOCAL)
        assert "--max-image-bytes" in await refused(f"{s.url}/huge", MediaConfig(allow_private_urls=True,
                                                                                max_image_bytes=len(png) * 2))
        assert "timed out after 0.5 s (--media-fetch-timeout)" in await refused(
            f"{s.url}/slow", MediaConfig(allow_private_urls=True, fetch_timeout_s=0.5))
        assert "not an image" in await refused(f"{s.url}/text", LOCAL)
        assert "not http or https" in await refused(f"{s.url}/to-file", LOCAL)
        # Without the allowance the same server is out of reach.
        assert "loopback" in await refused(f"{s.url}/a.png")


def test_media_bounds_are_checked():
    for kwargs in ({"max_image_bytes": 0}, {"max_image_bytes": 25 << 20}, {"max_images": 0},
                   {"fetch_timeout_s": 0}, {"max_redirects": -1}, {"max_image_pixels": 0}):
        with pytest.raises(ConfigError):
            MediaConfig(**kwargs)


# -- preprocess --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_tokenizer(model_dir, tmp_path_factory):
    # The text model's tokenizer with the test VLM's template (an image part becomes "<image>" text here).
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    return TextTokenizer.from_dir(model_dir, chat_template_path=template)


def table(tokenizer, multimodal: bool) -> ModelTable:
    models = ModelTable(registry=None, make_router=None)
    model = served(tokenizer, [instance("w", "127.0.0.1:1")])
    model.card.multimodal = multimodal
    models.models["m"] = model
    return models


def chat_body(*urls: str) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return msgspec.json.encode({"model": "m", "max_tokens": 4,
                                "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]})


async def test_images_go_to_the_worker_as_checked_bytes_in_prompt_order(vlm_tokenizer):
    red, blue = picture(), picture((20, 40, 220))
    p = await preprocess(chat_body(data_url(red), data_url(blue)), "chat", table(vlm_tokenizer, True))
    assert [i.data for i in p.request.images] == [red, blue]
    text = vlm_tokenizer.decode(p.request.token_ids, skip_special_tokens=False)
    assert "<image><image>Hi" in text
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p.request), type=GenerateRequest)
    assert wire.images == p.request.images
    # Text-only chats carry no images.
    p = await preprocess(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
                         "chat", table(vlm_tokenizer, True))
    assert p.request.images is None


def test_a_detail_other_than_auto_is_refused_not_ignored():
    part = {"type": "image_url", "image_url": {"url": "data:one", "detail": "auto"}}
    assert split_media([{"role": "user", "content": [part]}])[1] == [(WHERE, "data:one")]
    part["image_url"]["detail"] = "low"
    with pytest.raises(RequestError, match=r"image_url\.detail: 'low' is not supported"):
        split_media([{"role": "user", "content": [part]}])


def responses_body(url: str, **part) -> bytes:
    return msgspec.json.encode({"model": "m", "max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url, **part}, {"type": "input_text", "text": "Hi"}]}]})


async def test_responses_input_image_takes_the_chat_media_path(vlm_tokenizer):
    red = picture()
    chat = await preprocess(chat_body(data_url(red)), "chat", table(vlm_tokenizer, True))
    _, resp, _ = await responses.prepare(responses_body(data_url(red), detail="auto"), table(vlm_tokenizer, True))
    assert resp.request.token_ids == chat.request.token_ids and resp.request.images == chat.request.images
    # The media stage's refusals name the Responses field, under the operator's bounds.
    for url, cfg, why in [("http://127.0.0.1:9/x.png", MediaConfig(), "loopback"),
                          (data_url(picture(size=(40, 40))), MediaConfig(max_image_pixels=100), "--max-image-pixels"),
                          (data_url(b"not a picture"), MediaConfig(), "not an image")]:
        with pytest.raises(RequestError) as err:
            await responses.prepare(responses_body(url), table(vlm_tokenizer, True), cfg)
        assert err.value.param == "input" and err.value.message.startswith("input[0].content[0].image_url: ")
        assert why in err.value.message
    with pytest.raises(RequestError) as err:
        await responses.prepare(responses_body(data_url(red)), table(vlm_tokenizer, False))
    assert "--enable-multimodal" in err.value.message and err.value.message.startswith("input[0].content[0]")


async def test_without_enable_multimodal_images_are_refused_naming_the_flag(vlm_tokenizer):
    with pytest.raises(RequestError) as err:
        await preprocess(chat_body(data_url(picture())), "chat", table(vlm_tokenizer, False))
    assert "--enable-multimodal" in err.value.message and err.value.message.startswith(WHERE)


async def test_a_request_holds_a_bounded_number_of_images(vlm_tokenizer):
    with pytest.raises(RequestError, match="at most 1 images"):
        await preprocess(chat_body(data_url(picture()), data_url(picture())), "chat", table(vlm_tokenizer, True),
                         media=MediaConfig(max_images=1))


# -- --frontend-decoding, and max_tokens against the engine's widened prompt -------------------------------------
async def test_frontend_decoding_sends_pixels_the_worker_takes_as_the_files_image(vlm_tokenizer):
    from PIL import Image

    from turbine.vllm.images import decode_images

    red, blue = picture(), picture((20, 40, 220), size=(30, 50), fmt="JPEG")
    body = chat_body(data_url(red), data_url(blue, "image/jpeg"))
    files = await preprocess(body, "chat", table(vlm_tokenizer, True))
    pixels = await preprocess(body, "chat", table(vlm_tokenizer, True), media=MediaConfig(frontend_decoding=True))
    # Not the file: its decoded pixels, typed (dtype, shape) and raw, with the same hash; the rest as without.
    assert [i.data for i in pixels.request.images] == [b"", b""]
    assert [(i.pixels.dtype, i.pixels.shape) for i in pixels.request.images] == [("uint8", [40, 48, 3]),
                                                                                 ("uint8", [50, 30, 3])]
    assert [i.hash for i in pixels.request.images] == [i.hash for i in files.request.images]
    assert pixels.request.token_ids == files.request.token_ids
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(pixels.request), type=GenerateRequest)
    # The worker wraps the pixels (no decoding) into the image it would have decoded from the file.
    got = decode_images(wire.images)
    for image, data in zip(got, (red, blue)):
        assert image.mode == "RGB" and image.tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()


async def test_frontend_decoding_bounds_a_requests_decoded_pixels(vlm_tokenizer, monkeypatch):
    from turbine.frontend.preprocess import media

    body = chat_body(data_url(picture()), data_url(picture()))
    monkeypatch.setattr(media, "MAX_DECODED_BYTES", 48 * 40 * 3 * 2 - 1)  # one byte short of the two pictures
    with pytest.raises(RequestError, match="--frontend-decoding") as err:
        await preprocess(body, "chat", table(vlm_tokenizer, True), media=MediaConfig(frontend_decoding=True))
    assert err.value.param == "messages"
    # Each picture is bounded by --max-image-pixels before it is decoded, as without the flag.
    with pytest.raises(RequestError, match="--max-image-pixels"):
        await preprocess(body, "chat", table(vlm_tokenizer, True),
                         media=MediaConfig(frontend_decoding=True, max_image_pixels=100))


def test_frontend_decoding_flag_reaches_the_config():
    from turbine.frontend.args import build_parser, frontend_config_from_args

    parser = build_parser()
    assert frontend_config_from_args(parser.parse_args(["--frontend-decoding"]), parser).media.frontend_decoding
    assert not frontend_config_from_args(parser.parse_args([]), parser).media.frontend_decoding


async def test_max_tokens_is_checked_against_the_engines_widened_prompt(vlm_tokenizer):
    models = table(vlm_tokenizer, True)
    card = models.models["m"].card
    card.image_placeholder, card.image_placeholder_range = [5] * 19, (0, 19)  # as the worker measured it
    body = msgspec.json.decode(chat_body(data_url(picture())))
    plain = await preprocess(msgspec.json.encode(body), "chat", models)
    widened = len(plain.request.token_ids) + 18
    body["max_tokens"] = card.context_length - widened + 1
    with pytest.raises(RequestError) as err:
        await preprocess(msgspec.json.encode(body), "chat", models)
    assert err.value.param == "max_tokens"
    assert f"the prompt has {widened} tokens and max_tokens is {body['max_tokens']}" in err.value.message
    body["max_tokens"] -= 1
    assert (await preprocess(msgspec.json.encode(body), "chat", models)).request.stop.max_tokens == body["max_tokens"]
    # Without max_tokens, the default is what the widened prompt leaves of the context.
    del body["max_tokens"]
    assert (await preprocess(msgspec.json.encode(body), "chat", models)).request.stop.max_tokens == \
        card.context_length - widened

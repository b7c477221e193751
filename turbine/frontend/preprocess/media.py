"""Media in chat messages (issue #19): `image_url` content parts, as `data:` URLs or http(s) URLs.

The frontend is the one place that reads media from the outside: it fetches (bounded in bytes, time and
redirects; private, loopback and other non-global addresses refused unless the operator passes
--allow-private-media-urls), decodes with Pillow (PNG, JPEG, WebP only; bounded in pixels), hashes the decoded
pixels and sends the checked file bytes to the worker (GenerateRequest.images), which never fetches; with
--frontend-decoding it sends the decoded pixels instead (a uint8 [height, width, 3] array), so the worker never
decodes either, within the frame's bound on a request's decoded pixels (MAX_DECODED_BYTES). Video and
audio parts are refused by name. Every fault is a RequestError naming the part (HTTP 400)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpcore

from turbine.config import check, flag
from turbine.frontend.errors import RequestError
from turbine.frontend.preprocess.base64_payload import decode_base64
from turbine.protocol.generate import ImageInput, ImagePixels

PARAM = "messages"
FORMATS = ("PNG", "JPEG", "WEBP")
# Content part types of OpenAI's (and vLLM's) chat API that carry media this server does not take.
REFUSED_PARTS = {
    "input_audio": "audio", "audio_url": "audio", "video_url": "video", "file": "file",
    "image_embeds": "image embeddings", "image_pil": "image",
}
# The `detail` values this server honours: the default only (OpenAI's low/high/original pick a resolution).
DETAILS = (None, "auto")
_REDIRECTS = (301, 302, 303, 307, 308)
# A request's decoded pixels (--frontend-decoding) travel in one request-plane frame (32 MiB) with the rest.
MAX_DECODED_BYTES = 24 << 20


@dataclass(frozen=True)
class MediaConfig:
    """The operator's bounds on media in requests (frontend flags)."""

    max_image_bytes: int = flag("--max-image-bytes", default=8 << 20)  # the encoded file
    max_image_pixels: int = flag("--max-image-pixels", default=4096 * 4096)  # width x height
    max_images: int = flag("--max-images-per-request", default=8)
    fetch_timeout_s: float = flag("--media-fetch-timeout", default=10.0)  # a whole fetch, redirects included
    max_redirects: int = flag("--media-max-redirects", default=3)
    # Lets image URLs reach private, loopback, link-local and other non-global addresses (off: no
    # server-side request forgery into the operator's network through this frontend).
    allow_private_urls: bool = flag("--allow-private-media-urls", default=False)
    # Sends workers the decoded pixels (ImageInput.pixels) instead of the file: workers decode nothing.
    frontend_decoding: bool = flag("--frontend-decoding", default=False)

    def __post_init__(self):
        # The bytes travel in one request-plane frame (32 MiB), all images of a request together.
        check(self, 1 <= self.max_image_bytes <= 24 << 20, "max_image_bytes", "must be between 1 and 24 MiB")
        check(self, self.max_image_pixels >= 1, "max_image_pixels", "must be >= 1")
        check(self, 1 <= self.max_images <= 64, "max_images", "must be between 1 and 64")
        check(self, self.fetch_timeout_s > 0, "fetch_timeout_s", "must be > 0 (seconds)")
        check(self, self.max_redirects >= 0, "max_redirects", "must be >= 0")


def split_media(messages: list[Any]) -> tuple[list[Any], list[tuple[str, str]]]:
    """The messages with each `image_url` part replaced by `{"type": "image"}` (what chat templates place
    the image token for), and the images' (where, url) in prompt order. RequestError for a media kind this
    server does not take, or a malformed part; other parts are left for the chat template's checks."""
    out, urls = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in REFUSED_PARTS:
                raise RequestError(f"{where}: {kind!r} parts ({REFUSED_PARTS[kind]}) are not supported; this "
                                   "server takes text and image_url parts", param=PARAM)
            if kind == "image":  # not OpenAI's: a client's own placeholder would desynchronize the images
                raise RequestError(f"{where}: content part of type 'image' is not supported; send images as "
                                   "image_url parts", param=PARAM)
            if kind != "image_url":
                parts.append(part)
                continue
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise RequestError(f"{where}.image_url: must be an object with a 'url' string", param=PARAM)
            detail = value.get("detail") if isinstance(value, dict) else None
            if detail not in DETAILS:  # the model's processor sizes every picture alike: no detail level to choose
                raise RequestError(f"{where}.image_url.detail: {detail!r} is not supported; leave it out or send "
                                   "'auto' (the model's image processor decides the resolution)", param=PARAM)
            urls.append((f"{where}.image_url", url))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, urls


def refuse_media(model_name: str, urls: list[tuple[str, str]], why: str) -> None:
    if urls:
        raise RequestError(f"{urls[0][0]}: the model {model_name!r} takes no images: {why}", param=PARAM)


async def load_images(urls: list[tuple[str, str]], cfg: MediaConfig) -> list[ImageInput]:
    """Each image fetched or decoded from its data: URL, checked and hashed (concurrently)."""
    if len(urls) > cfg.max_images:
        raise RequestError(f"{urls[cfg.max_images][0]}: a request may hold at most {cfg.max_images} images "
                           "(--max-images-per-request)", param=PARAM)
    images = list(await asyncio.gather(*(load_image(where, url, cfg) for where, url in urls)))
    if cfg.frontend_decoding and (total := sum(len(i.pixels.data) for i in images)) > MAX_DECODED_BYTES:
        raise RequestError(f"{urls[0][0]}: the request's images take {total} bytes decoded, over the "
                           f"{MAX_DECODED_BYTES} one request may carry with --frontend-decoding (send smaller "
                           "images; --max-image-pixels bounds each)", param=PARAM)
    return images


async def load_image(where: str, url: str, cfg: MediaConfig) -> ImageInput:
    scheme = url.partition(":")[0].lower()  # (urlsplit raises on some malformed URLs: httpcore checks the rest)
    if scheme == "data":
        data = await _data_url_bytes(where, url, cfg)
    elif scheme in ("http", "https") and url[len(scheme):].startswith("://"):
        data = await fetch(where, url, cfg)
    else:
        raise RequestError(f"{where}: unsupported URL {_short(url)!r}: give a data: URL (base64) or an http(s) URL",
                           param=PARAM)
    if cfg.frontend_decoding:
        digest, rgb = await asyncio.to_thread(decode_image, where, data, cfg.max_image_pixels)
        pixels = ImagePixels(dtype="uint8", shape=[rgb.height, rgb.width, 3], data=rgb.tobytes())
        return ImageInput(hash=digest, pixels=pixels)
    digest = await asyncio.to_thread(check_image, where, data, cfg.max_image_pixels)
    return ImageInput(data=data, hash=digest)


def check_image(where: str, data: bytes, max_pixels: int) -> str:
    """Decodes the file with Pillow (a supported format, within the pixel bound, not truncated) and returns
    the SHA-256 of its decoded RGB pixels and size: the same picture in another lossless file hashes alike."""
    return decode_image(where, data, max_pixels)[0]


def decode_image(where: str, data: bytes, max_pixels: int):
    """check_image's hash and the decoded RGB image (a PIL image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise RequestError(f"{where}: unsupported image format {image.format}; supported: "
                                   f"{', '.join(FORMATS)}", param=PARAM)
            width, height = image.size
            # Checked from the header, before the pixels are decoded (a decompression bomb stops here).
            if width * height > max_pixels:
                raise RequestError(f"{where}: the image is {width}x{height} pixels, over the limit of {max_pixels} "
                                   "(--max-image-pixels)", param=PARAM)
            rgb = image.convert("RGB")
    except RequestError:
        raise
    except UnidentifiedImageError:
        raise RequestError(f"{where}: not an image in a supported format ({', '.join(FORMATS)})",
                           param=PARAM) from None
    except Exception as exc:  # truncated or corrupt: Pillow's decoders raise many kinds, all the request's fault
        raise RequestError(f"{where}: the image cannot be decoded: {exc}", param=PARAM) from None
    h = hashlib.sha256(f"RGB {width}x{height}\n".encode())
    h.update(rgb.tobytes())
    return h.hexdigest(), rgb


async def _data_url_bytes(where: str, url: str, cfg: MediaConfig) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise RequestError(f"{where}: a data: URL needs a ',' before its data", param=PARAM)
    mime, *params = header[len("data:"):].split(";")
    if "base64" not in params:
        raise RequestError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", param=PARAM)
    if mime and not mime.lower().startswith("image/"):
        raise RequestError(f"{where}: a data: URL of type {mime!r} is not an image", param=PARAM)
    return await decode_base64(payload, max_bytes=cfg.max_image_bytes, where=f"{where} (data: URL)",
                               what="the image", flag="--max-image-bytes", param=PARAM)


def address_refusal(ip: str) -> str | None:
    """Why a fetch may not connect to `ip` (None: it may): only global unicast addresses are reached."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return "a loopback address"
    if addr.is_private or addr.is_link_local or addr.is_unspecified or addr.is_reserved or addr.is_multicast \
            or not addr.is_global:
        return "a private or non-global address"
    return None


class _MediaFetchRefused(Exception):
    pass


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves the host itself and connects only to an address it checked, so a name cannot resolve to a
    public address for the check and a private one for the connection (DNS rebinding). TLS still verifies
    the URL's host name (httpcore takes it from the URL, not from the address connected to)."""

    def __init__(self, allow_private: bool):
        self._inner = httpcore.AnyIOBackend()
        self._allow_private = allow_private

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise _MediaFetchRefused(f"{host} does not resolve")
        ips = [info[4][0] for info in infos]
        if not self._allow_private:
            for ip in ips:
                if (why := address_refusal(ip)) is not None:
                    raise _MediaFetchRefused(f"{host} resolves to {why} ({ip}); an operator may allow that with "
                                             "--allow-private-media-urls")
        return await self._inner.connect_tcp(ips[0], port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def fetch(where: str, url: str, cfg: MediaConfig) -> bytes:
    """The body of an http(s) URL: redirects followed up to --media-max-redirects (each hop checked again),
    at most --max-image-bytes, all within --media-fetch-timeout. No proxy from the environment is used."""
    try:
        async with asyncio.timeout(cfg.fetch_timeout_s):
            async with httpcore.AsyncConnectionPool(network_backend=_GuardedBackend(cfg.allow_private_urls),
                                                    max_connections=1) as pool:
                for _hop in range(cfg.max_redirects + 1):
                    url = _ascii_url(where, url)
                    status, location, body = await _get(pool, where, url, cfg.max_image_bytes)
                    if status not in _REDIRECTS:
                        if status != 200:
                            raise RequestError(f"{where}: fetching {_short(url)!r} answered HTTP {status}",
                                               param=PARAM)
                        return body
                    if not location:
                        raise RequestError(f"{where}: {_short(url)!r} redirects without a Location", param=PARAM)
                    url = urljoin(url, location)
                    if urlsplit(url).scheme.lower() not in ("http", "https"):
                        raise RequestError(f"{where}: a redirect to {_short(url)!r} (not http or https)", param=PARAM)
                raise RequestError(f"{where}: more than {cfg.max_redirects} redirects (--media-max-redirects)",
                                   param=PARAM)
    except TimeoutError:
        raise RequestError(f"{where}: fetching the image timed out after {cfg.fetch_timeout_s:g} s "
                           "(--media-fetch-timeout)", param=PARAM) from None
    except _MediaFetchRefused as exc:
        raise RequestError(f"{where}: refused to fetch {_short(url)!r}: {exc}", param=PARAM) from None
    except (httpcore.ProtocolError, httpcore.NetworkError, httpcore.UnsupportedProtocol, OSError, ValueError,
            TypeError) as exc:
        # (ValueError: a URL that httpcore or the resolver cannot take, e.g. a bad port or IDNA name)
        raise RequestError(f"{where}: fetching {_short(url)!r} failed: {type(exc).__name__}: {exc}",
                           param=PARAM) from None


async def _get(pool: httpcore.AsyncConnectionPool, where: str, url: str, max_bytes: int) -> tuple[int, str, bytes]:
    headers = [(b"Accept", b"image/png, image/jpeg, image/webp"), (b"User-Agent", b"turbine-frontend")]
    async with pool.stream("GET", url, headers=headers) as response:
        location = ""
        for name, value in response.headers:
            lname = name.lower()
            if lname == b"location":
                location = value.decode("latin-1")
            elif lname == b"content-length" and value.isdigit() and int(value) > max_bytes:
                raise RequestError(f"{where}: the image is {int(value)} bytes, over the limit of {max_bytes} "
                                   "(--max-image-bytes)", param=PARAM)
        if response.status != 200:
            return response.status, location, b""
        body = bytearray()
        async for chunk in response.aiter_stream():
            body += chunk
            if len(body) > max_bytes:  # a server that sends more than it announced (or no length)
                raise RequestError(f"{where}: the image is over the limit of {max_bytes} bytes (--max-image-bytes)",
                                   param=PARAM)
        return 200, location, bytes(body)


def _ascii_url(where: str, url: str) -> str:
    """The URL as httpcore takes it: IDNA host, percent-encoded path (httpx's parser, as clients use)."""
    import httpx  # here, not at the top: ~0.15 s of every frontend start, needed only for an image URL

    try:
        return str(httpx.URL(url))
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise RequestError(f"{where}: the URL {_short(url)!r} is malformed: {exc}", param=PARAM) from None


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."

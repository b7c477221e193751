"""GenerateRequest.images (a worker with --enable-multimodal) → the engine's multi-modal data.

The frontend fetched, decoded and bounded each image already; a worker still decodes what comes off the socket
with Pillow alone (PNG, JPEG or WebP, within a pixel bound) and never fetches. An image the frontend decoded
itself (its --frontend-decoding: ImageInput.pixels, a uint8 [height, width, 3] array) is only wrapped as a PIL
image, never decoded. Each image's hash (of its decoded pixels) is its identifier in the engine
(multi_modal_uuids): its encoder cache, prefix cache and KV events key on it, so two different images never
share cached KV. Every fault is an InvalidRequest naming images.

measured_placeholder: what the engine widens one image token to, measured at start, for the card."""

from __future__ import annotations

import io
import logging

from turbine.protocol.generate import ImageInput, ImagePixels
from turbine.runtime.errors import InvalidRequest

log = logging.getLogger("turbine.vllm")

PARAM = "images"
FORMATS = ("PNG", "JPEG", "WEBP")
# Far above the frontend's default (--max-image-pixels, 16.7 M): a backstop against decompression bombs.
MAX_PIXELS = 64 << 20


def decode_images(images: list[ImageInput]) -> list:
    """The images as RGB PIL images, in order."""
    from PIL import Image

    out = []
    for i, item in enumerate(images):
        if item.pixels is not None:
            if item.data:
                raise InvalidRequest(f"{PARAM}[{i}]: give the image's data or its pixels, not both")
            out.append(pixels_image(i, item.pixels))
            continue
        try:
            with Image.open(io.BytesIO(item.data)) as image:
                if image.format not in FORMATS:
                    raise InvalidRequest(f"{PARAM}[{i}]: unsupported image format {image.format}")
                if image.size[0] * image.size[1] > MAX_PIXELS:
                    raise InvalidRequest(f"{PARAM}[{i}]: the image is too large ({image.size[0]}x{image.size[1]})")
                out.append(image.convert("RGB"))
        except InvalidRequest:
            raise
        except Exception as exc:  # Pillow's many decoder errors: the request's fault, never the worker's
            raise InvalidRequest(f"{PARAM}[{i}]: the image cannot be decoded: {type(exc).__name__}: {exc}") from None
    return out


def pixels_image(i: int, pixels: ImagePixels):
    """A decoded image (uint8, [height, width, 3]) as a PIL RGB image: its bytes are taken as they are."""
    from PIL import Image

    shape = pixels.shape
    if pixels.dtype != "uint8" or len(shape) != 3 or shape[2] != 3 or min(shape) < 1:
        raise InvalidRequest(f"{PARAM}[{i}].pixels: expected dtype uint8 and shape [height, width, 3], got "
                             f"{pixels.dtype} {shape}")
    height, width = shape[0], shape[1]
    if height * width > MAX_PIXELS:
        raise InvalidRequest(f"{PARAM}[{i}]: the image is too large ({width}x{height})")
    if len(pixels.data) != height * width * 3:
        raise InvalidRequest(f"{PARAM}[{i}].pixels: {len(pixels.data)} bytes for shape {shape} "
                             f"({height * width * 3} expected)")
    return Image.frombytes("RGB", (width, height), pixels.data)


def multimodal_prompt(token_ids: list[int], images: list[ImageInput]) -> dict:
    """The engine's prompt: the token ids, whose image tokens the engine's processor widens to each image's
    placeholder tokens, with the decoded images and their identifiers."""
    return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": decode_images(images)},
            "multi_modal_uuids": {"image": [item.hash for item in images]}}


PROBE_SIZES = ((32, 48), (400, 224))  # (width, height): two unlike pictures


def measured_placeholder(renderer, image_token_id: int) -> tuple[list[int], tuple[int, int]] | None:
    """The token ids the engine's processor widens one image token to and the image's placeholder range
    (offset, length) within them, when both are the same for pictures of unlike sizes (None: they differ, as
    for models that tile or size the placeholder by the picture, or the probe failed). `renderer`: the engine's
    (AsyncLLM.renderer), which turns a prompt into the engine's input as every request's is."""
    from PIL import Image

    seen = set()
    for size in PROBE_SIZES:
        prompt = {"prompt_token_ids": [image_token_id], "multi_modal_data": {"image": [Image.new("RGB", size)]}}
        try:
            (engine_input,) = renderer.render_cmpl([prompt], skip_mm_cache=True)
            (where,) = engine_input["mm_placeholders"]["image"]
            seen.add((tuple(engine_input["prompt_token_ids"]), (where.offset, where.length)))
        except Exception as exc:  # an engine whose renderer takes no such probe: routing keys the unwidened prompt
            log.warning("the image placeholder could not be measured (%s: %s); KV routing matches image "
                        "prompts up to their first image", type(exc).__name__, exc)
            return None
    if len(seen) != 1:
        log.info("the image placeholder depends on the picture: KV routing matches image prompts up to their "
                 "first image")
        return None
    ids, where = seen.pop()
    return list(ids), where

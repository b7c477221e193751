"""GenerateRequest.images (a worker with --enable-multimodal) → the engine's multi-modal data.

The frontend fetched, decoded and bounded each image already; a worker still decodes what comes off the socket
with Pillow alone (PNG, JPEG or WebP, within a pixel bound) and never fetches. Each image's hash (of its decoded
pixels) is its identifier in the engine (multi_modal_uuids): its encoder cache, prefix cache and KV events key on
it, so two different images never share cached KV. Every fault is an InvalidRequest naming images."""

from __future__ import annotations

import io

from turbine.protocol.generate import ImageInput
from turbine.runtime.errors import InvalidRequest

PARAM = "images"
FORMATS = ("PNG", "JPEG", "WEBP")
# Far above the frontend's default (--max-image-pixels, 16.7 M): a backstop against decompression bombs.
MAX_PIXELS = 64 << 20


def decode_images(images: list[ImageInput]) -> list:
    """The images as RGB PIL images, in order."""
    from PIL import Image

    out = []
    for i, item in enumerate(images):
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


def multimodal_prompt(token_ids: list[int], images: list[ImageInput]) -> dict:
    """The engine's prompt: the token ids, whose image tokens the engine's processor widens to each image's
    placeholder tokens, with the decoded images and their identifiers."""
    return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": decode_images(images)},
            "multi_modal_uuids": {"image": [item.hash for item in images]}}

"""Bounded base64 decoding of the binary payloads requests carry (prompt embeddings, images in
data: URLs): an oversized payload is refused before it is decoded, a large one is decoded off
the event loop, and every fault is the client's 400 naming where the payload was."""

from __future__ import annotations

import asyncio
import binascii

import pybase64

from turbine.frontend.errors import RequestError

# Larger payloads are decoded off the event loop, which serves every other request meanwhile.
DECODE_IN_THREAD_CHARS = 256 << 10


async def decode_base64(text: str, *, max_bytes: int, where: str, what: str, flag: str, param: str) -> bytes:
    """`text`'s bytes (never empty), or a RequestError that says `where` and names `flag` when
    the decoded size would be over `max_bytes`; `what` names the payload in that message."""
    # Base64 is 4 characters per 3 bytes.
    if len(text) > (max_bytes + 2) // 3 * 4:
        raise RequestError(f"{where}: {what} is over the limit of {max_bytes} bytes ({flag})", param=param)
    try:
        if len(text) > DECODE_IN_THREAD_CHARS:
            data = await asyncio.to_thread(pybase64.b64decode, text, validate=True)
        else:
            data = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{where}: not valid base64: {exc}", param=param) from None
    if not data:
        raise RequestError(f"{where}: is empty", param=param)
    return data

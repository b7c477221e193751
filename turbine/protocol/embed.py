"""The `embed` request-plane endpoint of pooling workers (a vLLM worker started with
`--runner pooling`): token ids in, one embedding per input out. Served by workers whose card
lists "embeddings" in its endpoint_types; the frontend's /v1/embeddings calls it."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1

EMBED_ENDPOINT = "embed"


class EmbedRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    model: str
    inputs: list[list[int]]  # each a tokenized input, embedded on its own
    v: int = WIRE_VERSION


class EmbedOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    # One per input, in order: float32 little-endian bytes (OpenAI's base64 format, undecoded).
    embeddings: list[bytes]
    prompt_tokens: int
    v: int = WIRE_VERSION

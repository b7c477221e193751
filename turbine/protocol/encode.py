"""The `encode` contract between the frontend and encode workers (disaggregated encode, issue #19), and how
an image's embeddings travel from an encode worker to the prefill/decode worker that takes them.

The frontend sends an encode worker the images it fetched and checked (ImageInput: the file and the hash of
its decoded pixels); the worker answers, per image, where its embeddings are: a file on this host
(`file` transport) or a buffer in the encode worker's memory that a NIXL agent reads (`nixl`). The frontend
puts those locations on the GenerateRequest (`image_embeddings`), and the prefill/decode worker's engine loads
them instead of running the vision encoder. Nothing is pickled: a file or a buffer holds raw values, described
by a typed header (dtype, shape) in msgpack (turbine/vllm/embedding_store.py)."""

from __future__ import annotations

import msgspec

from turbine.protocol.generate import ImageEmbedding, ImageInput, NixlSource

__all__ = ["EncodeReply", "EncodeRequest", "ImageEmbedding", "NixlSource"]

WIRE_VERSION = 1
ENCODE_ENDPOINT = "encode"
# The card's endpoint type of an encode worker (it serves no chat or completions).
IMAGE_ENCODE = "image_encode"
EMBEDDING_TRANSPORTS = ("nixl", "file")
EMBEDDING_DTYPES = ("float32", "bfloat16", "float16")


class EncodeRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    images: list[ImageInput]
    transport: str = "nixl"
    v: int = WIRE_VERSION


class EncodeReply(msgspec.Struct, omit_defaults=True, kw_only=True):
    embeddings: list[ImageEmbedding]  # one per image, in order
    encoded: int = 0  # how many of them the encoder computed now (the rest were cached)
    v: int = WIRE_VERSION

"""A worker's LoRA adapter control: the request-plane payloads of its `load_lora`, `unload_lora`
and `list_loras` endpoints (the status server's /v1/loras routes take the same fields as JSON).

An adapter is loaded under a name (what clients put in `model`) from a source URI; the worker
gives it an id (unique in the process, what the engine knows it by) and publishes it in
discovery as a model card of its own whose base is the worker's model."""

from __future__ import annotations

import re

import msgspec

from turbine.protocol.errors import WIRE_VERSION

LOAD_LORA, UNLOAD_LORA, LIST_LORAS = "load_lora", "unload_lora", "list_loras"

# An adapter name is a discovery key part and an OpenAI model name: no '/', no spaces.
LORA_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# Reply codes (beside status "error"): what a status route maps to an HTTP status.
INVALID = "invalid"  # the request or the adapter is bad (400)
NOT_FOUND = "not_found"  # no adapter of that name is loaded (404)
UNSUPPORTED = "unsupported"  # this worker takes no adapters (e.g. vLLM without --enable-lora) (501)
FAILED = "failed"  # the engine or discovery failed; nothing was changed (500)


def lora_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not LORA_NAME_PATTERN.fullmatch(name):
        return (f"lora_name {name!r}: 1 to 128 characters, letters, digits and '._:-', "
                "starting with a letter or digit")
    return None


class LoraSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A local folder (absolute or relative path), file:///folder, or hf://owner/repo[@revision].
    uri: str


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    source: LoraSource
    v: int = WIRE_VERSION


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    v: int = WIRE_VERSION


class ListLorasRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    v: int = WIRE_VERSION


class LoraInfo(msgspec.Struct, kw_only=True):
    """One loaded adapter."""

    lora_name: str
    lora_id: int
    uri: str  # the source it was loaded from, as given
    path: str  # the local folder the engine reads
    rank: int = 0  # adapter_config.json's r


class LoraReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str  # "success" | "error"
    message: str = ""
    lora_name: str | None = None
    lora_id: int | None = None
    code: str | None = None  # with status "error": INVALID, NOT_FOUND, UNSUPPORTED or FAILED
    v: int = WIRE_VERSION


class ListLorasReply(msgspec.Struct, kw_only=True):
    status: str = "success"
    loras: list[LoraInfo] = msgspec.field(default_factory=list)
    v: int = WIRE_VERSION

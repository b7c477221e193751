"""Stored responses and conversations as typed records in the response store
(turbine/frontend/apis/state_store.py): save and load, the owner check, a response's context (the
input and output items of it and every response before it, through `previous_response_id`), and
a conversation's items (appended to after every response that names it).

A record belongs to the API key that created it (its SHA-256, never the key): another key gets
the same 404 as for an id that never existed. Records are msgspec JSON, decoded into these
structs: nothing read from the store is unpickled."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import msgspec

from turbine.frontend.apis.state_store import Conflict, Kv
from turbine.frontend.errors import RequestError

MAX_CHAIN = 10_000  # responses followed back through previous_response_id (each is one store read)
CAS_TRIES = 8  # a conversation's append against concurrent appends from other frontends


class StoredResponse(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    previous_response_id: str | None = None
    conversation_id: str | None = None
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    response: dict[str, Any]  # the response object as answered (status, output, usage ...)
    cancel_requested: bool = False  # background: a cancel that reached another frontend


class Conversation(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str] = {}
    items: list[dict[str, Any]] = []


_encode = msgspec.json.Encoder().encode
_decode_response = msgspec.json.Decoder(StoredResponse).decode
_decode_conversation = msgspec.json.Decoder(Conversation).decode


def owner_of(api_key: str | None) -> str:
    return "" if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()[:32]


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def not_found(kind: str, id_: str, param: str) -> RequestError:
    return RequestError(f"{kind} {id_!r} not found", param=param, status=404, code="not_found")


def _checked_id(id_: str, prefix: str, kind: str, param: str) -> str:
    # Ids go into store keys: only ours ("resp_<hex>") can exist, anything else is simply not found.
    if not (id_.startswith(prefix) and id_[len(prefix):].isalnum() and len(id_) <= 128):
        raise not_found(kind, id_, param)
    return id_


class Records:
    """The response store's records, for one frontend."""

    def __init__(self, kv: Kv):
        self.kv = kv

    def _fits(self, data: bytes, what: str, param: str) -> bytes:
        limit = getattr(self.kv, "max_record_bytes", None)
        if limit is not None and len(data) > limit:
            raise RequestError(f"{what} would take {len(data)} bytes in the response store, over its limit of "
                               f"{limit} (--response-store-max-record-bytes); send store: false and the whole "
                               "conversation in input instead", param=param, status=413)
        return data

    # -- responses --
    def check_input_fits(self, input_items: list[dict[str, Any]]) -> None:
        """A request whose input alone could not be stored is refused before it is generated."""
        self._fits(_encode(input_items), "this request's input", "store")

    async def save_response(self, record: StoredResponse) -> None:
        await self.kv.put("resp." + record.id, self._fits(_encode(record), "the response", "store"))

    async def response(self, id_: str, owner: str, param: str = "response_id") -> StoredResponse:
        got = await self.kv.get("resp." + _checked_id(id_, "resp_", "response", param))
        if got is None:
            raise not_found("response", id_, param)
        record = _decode_response(got[0])
        if record.owner != owner:
            raise not_found("response", id_, param)
        return record

    async def delete_response(self, id_: str, owner: str) -> None:
        await self.response(id_, owner)
        await self.kv.delete("resp." + id_)

    async def request_cancel(self, id_: str, owner: str) -> StoredResponse:
        for _ in range(CAS_TRIES):
            got = await self.kv.get("resp." + _checked_id(id_, "resp_", "response", "response_id"))
            if got is None:
                raise not_found("response", id_, "response_id")
            record = _decode_response(got[0])
            if record.owner != owner:
                raise not_found("response", id_, "response_id")
            record.cancel_requested = True
            try:
                await self.kv.update("resp." + id_, _encode(record), got[1])
                return record
            except Conflict:
                continue
        raise RequestError(f"response {id_!r} kept changing; retry the cancel", status=409)

    async def context(self, previous_id: str, owner: str) -> list[dict[str, Any]]:
        """The items a follow-up of `previous_id` continues from: every earlier response's input and
        output, oldest first. A response missing from the chain is a 404 naming it."""
        chain: list[StoredResponse] = []
        id_: str | None = previous_id
        while id_ is not None and len(chain) < MAX_CHAIN:
            record = await self.response(id_, owner, "previous_response_id")
            if record.response.get("status") in ("queued", "in_progress"):
                raise RequestError(f"previous_response_id: response {id_!r} is still {record.response['status']}; "
                                   "wait for it to finish", param="previous_response_id")
            chain.append(record)
            id_ = record.previous_response_id
        items: list[dict[str, Any]] = []
        for record in reversed(chain):
            items += record.input_items
            items += record.response.get("output") or []
        return items

    # -- conversations --
    async def create_conversation(self, owner: str, items: list[dict[str, Any]],
                                  metadata: dict[str, str] | None) -> Conversation:
        conv = Conversation(id=new_id("conv_"), owner=owner, created_at=int(time.time()),
                            metadata=metadata or {}, items=with_ids(items))
        await self.kv.create("conv." + conv.id, self._fits(_encode(conv), "the conversation", "items"))
        return conv

    async def conversation(self, id_: str, owner: str, param: str = "conversation_id") -> Conversation:
        return (await self._conversation(id_, owner, param))[0]

    async def _conversation(self, id_: str, owner: str, param: str) -> tuple[Conversation, int]:
        got = await self.kv.get("conv." + _checked_id(id_, "conv_", "conversation", param))
        if got is None:
            raise not_found("conversation", id_, param)
        conv = _decode_conversation(got[0])
        if conv.owner != owner:
            raise not_found("conversation", id_, param)
        return conv, got[1]

    async def change_conversation(self, id_: str, owner: str, change, param: str = "conversation_id") -> Conversation:
        """Applies `change(conversation)` with compare-and-set, again on a concurrent change (another
        frontend appending to the same conversation)."""
        for _ in range(CAS_TRIES):
            conv, revision = await self._conversation(id_, owner, param)
            change(conv)
            data = self._fits(_encode(conv), "the conversation", param)
            try:
                await self.kv.update("conv." + id_, data, revision)
                return conv
            except Conflict:
                continue
        raise RequestError(f"conversation {id_!r} kept changing under concurrent writes; retry", status=409,
                           param=param)

    async def delete_conversation(self, id_: str, owner: str) -> None:
        await self.conversation(id_, owner)
        await self.kv.delete("conv." + id_)


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored: each with an id (the client's, or a new one), messages typed."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if not isinstance(item.get("id"), str) or not item["id"]:
            prefixes = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
            item["id"] = new_id(prefixes.get(kind, "item_") if isinstance(kind, str) else "item_")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out

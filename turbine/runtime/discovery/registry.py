"""Typed discovery records on top of a DiscoveryBackend.

Keys: instances/{ns}/{component}/{endpoint}/{instance_id} -> msgpack InstanceRecord
      models/{ns}/{component}/{endpoint}/{instance_id}    -> msgpack ModelCard
      models/{ns}/{component}/{endpoint}/{instance_id}/lora/{name} -> msgpack ModelCard of an adapter
      (a card is served only while its instance record is there, and lives on its process's lease)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.runtime import codec
from turbine.runtime.discovery.base import DiscoveryBackend
from turbine.runtime.errors import DecodeError

logger = logging.getLogger("turbine.discovery")

INSTANCES = "instances/"
MODELS = "models/"

T = TypeVar("T")


def _checked(path: str) -> str:
    parts = path.split("/")
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"discovery path parts must be non-empty and contain no '/': {path!r}")
    return path


def _card_key(card: ModelCard) -> str:
    _checked(card.path)
    if card.lora_name is not None and (not card.lora_name or "/" in card.lora_name):
        raise ValueError(f"an adapter's name must be non-empty and contain no '/': {card.lora_name!r}")
    return card.key


def _decode_all(entries: dict[str, bytes], prefix: str, type_: type[T]) -> list[T]:
    """Decode the values under `prefix` in key order; a bad value is logged and skipped."""
    items = []
    for key in sorted(entries):
        if key.startswith(prefix):
            try:
                items.append(codec.decode(entries[key], type_))
            except DecodeError as exc:
                logger.warning("skipping discovery key %r: %s", key, exc)
    return items


class Registry:
    def __init__(self, backend: DiscoveryBackend) -> None:
        self.backend = backend

    async def register_instance(self, rec: InstanceRecord) -> None:
        await self.backend.put(INSTANCES + _checked(rec.path), codec.encode(rec))

    async def register_model(self, card: ModelCard) -> None:
        await self.backend.put(MODELS + _card_key(card), codec.encode(card))

    async def unregister_model(self, card: ModelCard) -> None:
        """Remove one card (e.g. an unloaded adapter's); its instance stays."""
        await self.backend.delete(MODELS + _card_key(card))

    async def unregister_instance(self, rec: InstanceRecord) -> None:
        """Remove the instance and the (base) model card published under the same path; its
        adapters' cards are removed by whoever published them (and go with the lease)."""
        path = rec.path
        await self.backend.delete(MODELS + path)
        await self.backend.delete(INSTANCES + path)

    async def list_instances(self) -> list[InstanceRecord]:
        return _decode_all(await self.backend.get_prefix(INSTANCES), INSTANCES, InstanceRecord)

    async def list_models(self) -> list[ModelCard]:
        return _decode_all(await self.backend.get_prefix(MODELS), MODELS, ModelCard)

    async def watch(self) -> AsyncIterator[tuple[list[InstanceRecord], list[ModelCard]]]:
        """Yield (instances, models) now and after every change to either."""
        last: dict[str, bytes] | None = None
        async for snapshot in self.backend.watch_prefix(""):
            # The backend root may hold other keys; only ours count as a change.
            ours = {k: v for k, v in snapshot.items() if k.startswith((INSTANCES, MODELS))}
            if ours != last:
                last = ours
                yield _decode_all(ours, INSTANCES, InstanceRecord), _decode_all(ours, MODELS, ModelCard)

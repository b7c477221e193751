"""Keeps a KV indexer in step with the KV events of a model's workers.

Failures are loud, never silent: a worker that publishes no events, a block size that differs
from the router's, and missed events (an event-id gap) each log a warning naming the worker.
"""

from __future__ import annotations

import asyncio
import logging

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import KvEventBatch
from turbine.runtime.codec import decode
from turbine.runtime.errors import DecodeError
from turbine.runtime.event_plane import EventSubscriber
from turbine.router.indexer import KvIndexer, WorkerKey

log = logging.getLogger("turbine.router")


class KvEventsConsumer:
    def __init__(self, index: KvIndexer):
        self.index = index
        self._sub = EventSubscriber()
        self._address_of: dict[str, str] = {}  # instance id -> its publisher's address
        self._last_event_id: dict[WorkerKey, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._task: asyncio.Task | None = None
        self.gaps = 0
        self.rejected = 0

    def sync(self, cards: dict[str, ModelCard]) -> None:
        """Follow exactly the publishers of these instances (call on every discovery change)."""
        for instance_id in self._address_of.keys() - cards.keys():
            self._sub.disconnect(self._address_of.pop(instance_id))
            for key in [k for k in self._last_event_id if k.instance_id == instance_id]:
                del self._last_event_id[key]
                self.index.remove_worker(key)
            self.index.remove_worker(WorkerKey(instance_id))
        for instance_id, card in cards.items():
            if card.kv_events_address is None:
                self._warn_once(instance_id, "no-events",
                                f"worker {instance_id} publishes no KV events: the kv router cannot see its "
                                "cache (run the frontend with --no-router-kv-events for approximate routing)")
            elif card.kv_block_size != self.index.block_size:
                self._warn_once(instance_id, "block-size",
                                f"worker {instance_id} uses KV block size {card.kv_block_size} but the router "
                                f"{self.index.block_size}: its cache is ignored")
            elif instance_id not in self._address_of:
                self._address_of[instance_id] = card.kv_events_address
                self._sub.connect(card.kv_events_address)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            _topic, payload = await self._sub.recv()
            try:
                batch = decode(payload, KvEventBatch)
            except DecodeError as exc:
                self.rejected += 1
                log.warning("undecodable KV event batch dropped: %s", exc)
                continue
            self.apply(batch)

    def apply(self, batch: KvEventBatch) -> None:
        if batch.instance_id not in self._address_of:
            return  # a worker we no longer follow
        worker = WorkerKey(batch.instance_id, batch.dp_rank)
        last = self._last_event_id.get(worker)
        if last is not None and batch.event_id != last + 1:
            self.gaps += 1
            log.warning("worker %s: KV events %d..%d were missed; its index may be stale until it "
                        "re-stores those blocks", batch.instance_id, last + 1, batch.event_id - 1)
        self._last_event_id[worker] = batch.event_id
        for event in batch.events:
            try:
                self.index.apply(worker, event, batch.lora_name)
            except ValueError as exc:
                self.rejected += 1
                self._warn_once(batch.instance_id, "bad-event", f"KV event rejected: {exc}")

    def _warn_once(self, instance_id: str, kind: str, message: str) -> None:
        if (instance_id, kind) not in self._warned:
            self._warned.add((instance_id, kind))
            log.warning(message)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sub.close()

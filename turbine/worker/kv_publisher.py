"""A worker's side of KV events: its cache events, numbered and published on the event plane.

It also keeps what a router needs to recover from missed events (see kv_replay.py): the recent
batches, encoded as they were sent, and the live cache state those events describe.
"""

from __future__ import annotations

import itertools
from collections import deque

import msgspec

from turbine.protocol.kv_events import KvEvent, KvEventBatch, KvReplayChunk
from turbine.runtime.codec import encode
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, EventPublisher
from turbine.worker.kv_cache_state import KvCacheState

DEFAULT_REPLAY_BUFFER = 10_000  # batches
REPLAY_BUFFER_MAX_BYTES = 8 << 20  # and at most this much encoded, whatever the batch count
REPLY_CHUNK_BYTES = 1 << 20  # a replay answer is sent in chunks of about this size


class KvEventPublisher:
    def __init__(self, instance_id: str, host: str = "127.0.0.1", dp_rank: int = 0, *,
                 events_plane=None, buffer_size: int = DEFAULT_REPLAY_BUFFER):
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        # Other worker topics (load metrics) share it; zmq unless the worker gave another backend.
        self.events_plane = events_plane if events_plane is not None else EventPublisher(host)
        self.address = self.events_plane.address
        self.next_event_id = 0
        self.state = KvCacheState()
        self.buffer_size = buffer_size
        # The latest encoded batches, of consecutive ids from _first_recent_id (bytes only: no
        # per-batch tuple for the garbage collector to scan).
        self._recent: deque[bytes] = deque()
        self._first_recent_id = 0
        self._recent_bytes = 0

    def publish(self, events: list[KvEvent], lora_name: str | None = None) -> KvEventBatch:
        batch = KvEventBatch(instance_id=self.instance_id, dp_rank=self.dp_rank, event_id=self.next_event_id,
                             events=events, lora_name=lora_name)
        data = encode(batch)
        for event in events:
            self.state.apply(event, lora_name)
        self._remember(batch.event_id, data)
        self.events_plane.publish_bytes(KV_EVENTS_TOPIC, data)
        self.next_event_id += 1
        return batch

    def _remember(self, event_id: int, data: bytes) -> None:
        recent = self._recent
        if not recent:
            self._first_recent_id = event_id
        recent.append(data)
        self._recent_bytes += len(data)
        while recent and (len(recent) > self.buffer_size or self._recent_bytes > REPLAY_BUFFER_MAX_BYTES):
            self._recent_bytes -= len(recent.popleft())
            self._first_recent_id += 1

    def replay(self, after_event_id: int) -> list[KvReplayChunk]:
        """What a router that applied everything up to `after_event_id` lacks: the batches after
        it if all are still buffered, else a snapshot of the live cache. Built at once, so it
        reflects exactly the events up to its event_id whatever is published while it is sent."""
        last = self.next_event_id - 1
        first_missed = max(after_event_id, -1) + 1
        recent = self._recent
        if after_event_id <= last and (first_missed > last or (recent and self._first_recent_id <= first_missed)):
            skip = first_missed - self._first_recent_id if recent else 0
            missed = [msgspec.Raw(data) for data in itertools.islice(recent, skip, None)]
            return _chunks(missed, snapshot=False, event_id=last)
        batches = self.state.snapshot(self.instance_id, self.dp_rank, last)
        return _chunks([msgspec.Raw(encode(b)) for b in batches], snapshot=True, event_id=last)

    def close(self) -> None:
        self.events_plane.close()


def _chunks(batches: list[msgspec.Raw], *, snapshot: bool, event_id: int) -> list[KvReplayChunk]:
    chunks = [KvReplayChunk(snapshot=snapshot, event_id=event_id)]
    size = 0
    for raw in batches:
        if size >= REPLY_CHUNK_BYTES:
            chunks.append(KvReplayChunk(snapshot=snapshot, event_id=event_id))
            size = 0
        chunks[-1].batches.append(raw)
        size += len(raw)
    return chunks

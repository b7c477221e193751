"""A worker's side of KV events: its cache events, numbered and published on the event plane."""

from __future__ import annotations

from turbine.protocol.kv_events import KvEvent, KvEventBatch
from turbine.runtime.event_plane import KV_EVENTS_TOPIC, EventPublisher


class KvEventPublisher:
    def __init__(self, instance_id: str, host: str = "127.0.0.1", dp_rank: int = 0):
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        self.events_plane = EventPublisher(host)  # other worker topics (load metrics) share it
        self.address = self.events_plane.address
        self.next_event_id = 0

    def publish(self, events: list[KvEvent], lora_name: str | None = None) -> None:
        self.events_plane.publish(KV_EVENTS_TOPIC, KvEventBatch(instance_id=self.instance_id, dp_rank=self.dp_rank,
                                       event_id=self.next_event_id, events=events, lora_name=lora_name))
        self.next_event_id += 1

    def close(self) -> None:
        self.events_plane.close()

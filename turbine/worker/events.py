"""One served instance's publishing on the event plane: load reports always (every worker kind,
whatever its role or prefix caching), and KV events per data-parallel rank where the worker
has them. All of it goes out through one publisher: one address in the model card."""

from __future__ import annotations

from turbine.runtime.event_plane import WorkerEventPlane
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.kv_replay import serve_kv_replay
from turbine.worker.load_publisher import LoadMetricsPublisher
from turbine.runtime.request_plane import RequestPlaneServer


class InstanceEvents:
    def __init__(self, plane: WorkerEventPlane, instance_id: str, *, data_parallel_size: int = 1,
                 kv_events: bool, kv_events_buffer: int):
        """`kv_events`: keep a KV event publisher per rank (and serve replays from them)."""
        self.publisher = plane.publisher(instance_id)
        self.address: str = self.publisher.address
        self.load = LoadMetricsPublisher(self.publisher, instance_id)
        self.kv: list[KvEventPublisher] = [
            KvEventPublisher(instance_id, dp_rank=rank, events_plane=self.publisher, buffer_size=kv_events_buffer)
            for rank in range(data_parallel_size)] if kv_events else []

    @property
    def kv_events_address(self) -> str | None:
        """For the model card: where its KV events are, None if it keeps none."""
        return self.address if self.kv else None

    def card_fields(self) -> dict:
        return {"kv_events_address": self.kv_events_address, "load_metrics_address": self.address}

    def serve_replay(self, server: RequestPlaneServer) -> None:
        """Routers that missed KV events recover them here (nothing to serve without KV events)."""
        if self.kv:
            serve_kv_replay(server, self.kv)

    def close(self) -> None:
        self.load.close()
        self.publisher.close()

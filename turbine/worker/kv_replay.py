"""The `kv_events_replay` endpoint of a worker that publishes KV events: a router that missed
some of a publisher's batches asks here for them (or for a snapshot when they are gone)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from turbine.protocol.kv_events import KvReplayChunk, KvReplayRequest
from turbine.runtime.errors import InvalidRequest
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.runtime.registration import KV_EVENTS_REPLAY
from turbine.runtime.request_plane import RequestPlaneServer


class KvEventsReplay:
    def __init__(self, publishers: Iterable[KvEventPublisher]):
        self.publishers = {p.dp_rank: p for p in publishers}

    async def handle(self, req: KvReplayRequest, ctx) -> AsyncIterator[KvReplayChunk]:
        publisher = self.publishers.get(req.dp_rank)
        if publisher is None:  # the router gets it as a typed error
            raise InvalidRequest(f"no KV event publisher for dp rank {req.dp_rank} "
                             f"(ranks: {', '.join(map(str, sorted(self.publishers)))})")
        for chunk in publisher.replay(req.after_event_id):  # built at once, before the first yield
            yield chunk


def serve_kv_replay(server: RequestPlaneServer, publishers: Iterable[KvEventPublisher]) -> None:
    server.register(KV_EVENTS_REPLAY, KvReplayRequest, KvEventsReplay(publishers).handle)

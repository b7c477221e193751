"""Asking a worker for the KV events a router missed (its `kv_events_replay` endpoint)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from turbine.protocol.kv_events import KvEventBatch, KvReplayChunk, KvReplayRequest
from turbine.router.indexer import WorkerKey
from turbine.runtime.codec import decode
from turbine.runtime.registration import KV_EVENTS_REPLAY
from turbine.runtime.request_plane import RequestPlaneClient


class RecoveryError(Exception):
    """The worker's answer is unusable (inconsistent); the caller retries."""


@dataclass
class Recovered:
    snapshot: bool  # True: `batches` are the whole live cache; else the missed batches in order
    event_id: int  # the last event id the answer reflects
    batches: list[KvEventBatch]


async def fetch_missed(client: RequestPlaneClient, address: str, worker: WorkerKey, after_event_id: int,
                       timeout_s: float) -> Recovered:
    """The batches of `worker` after `after_event_id`, or its snapshot. Raises RecoveryError and
    the request plane's errors (ConnectFailed, RemoteError, DecodeError, TimeoutError...)."""
    request = KvReplayRequest(after_event_id=after_event_id, dp_rank=worker.dp_rank)
    async with asyncio.timeout(timeout_s):
        async with client.stream(address, KV_EVENTS_REPLAY, request, KvReplayChunk) as stream:
            chunks = [chunk async for chunk in stream]
    if not chunks:
        raise RecoveryError("empty answer")
    snapshot, event_id = chunks[0].snapshot, chunks[0].event_id
    if any((c.snapshot, c.event_id) != (snapshot, event_id) for c in chunks):
        raise RecoveryError("chunks of one answer disagree")
    batches = [decode(raw, KvEventBatch) for c in chunks for raw in c.batches]
    if any((b.instance_id, b.dp_rank) != worker for b in batches):
        raise RecoveryError("batches of another publisher")
    if not snapshot:
        ids = [b.event_id for b in batches]
        if ids != list(range(after_event_id + 1, event_id + 1)):
            raise RecoveryError(f"replayed event ids {ids[:1]}..{ids[-1:]} do not follow {after_event_id} "
                                f"up to {event_id}")
    return Recovered(snapshot, event_id, batches)

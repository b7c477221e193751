"""A worker's memory of its KV events: the bounded buffer of recent batches, the snapshot of its
live cache, and the kv_events_replay endpoint that serves them (bad requests get error replies)."""

from __future__ import annotations

import gc

import msgspec
import pytest

from turbine.protocol.kv_events import BlockRemoved, BlockStored, KvEventBatch, KvReplayChunk, KvReplayRequest
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.worker import kv_publisher
from turbine.runtime.codec import decode
from turbine.runtime.errors import RemoteError
from turbine.worker.kv_cache_state import SNAPSHOT_BATCH_TOKENS
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.kv_replay import serve_kv_replay
from turbine.runtime.registration import KV_EVENTS_REPLAY
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer

BS = 4


def stored(first: int, n: int, parent: int | None = None) -> BlockStored:
    return BlockStored.from_token_ids(block_hashes=list(range(first, first + n)), parent_hash=parent,
                                      token_ids=[t % 1000 for t in range(first * BS, (first + n) * BS)], block_size=BS)


def batches_of(chunks: list[KvReplayChunk]) -> list[KvEventBatch]:
    return [decode(raw, KvEventBatch) for c in chunks for raw in c.batches]


def test_missed_batches_come_from_the_buffer_while_it_holds_them():
    pub = KvEventPublisher("w", buffer_size=3)
    sent = [pub.publish([stored(10 * i, 1)]) for i in range(5)]
    answer = pub.replay(2)
    assert [(c.snapshot, c.event_id) for c in answer] == [(False, 4)]
    assert batches_of(answer) == sent[3:]
    assert pub.replay(4)[0].batches == [] and not pub.replay(4)[0].snapshot  # nothing missed
    gone = pub.replay(0)  # batch 1 left the buffer: a snapshot instead
    assert gone[0].snapshot and gone[0].event_id == 4
    assert sorted(h for b in batches_of(gone) for e in b.events for h in e.block_hashes) == [0, 10, 20, 30, 40]
    pub.close()


def test_the_buffer_is_bounded_in_bytes_too(monkeypatch):
    monkeypatch.setattr(kv_publisher, "REPLAY_BUFFER_MAX_BYTES", 2000)
    pub = KvEventPublisher("w")
    for i in range(20):
        pub.publish([stored(100 * i, 20)])  # a few hundred bytes each
    assert 0 < len(pub._recent) < 20 and pub._recent_bytes <= 2000
    assert pub.replay(0)[0].snapshot
    pub.close()


def test_the_state_kept_per_block_and_per_batch_is_not_for_the_garbage_collector_to_scan():
    # A worker keeps one entry per cached block (100+ workers x 16384 blocks in a mocker
    # process) and thousands of recent batches: if the collector tracked them, each of its
    # passes would scan them all while every simulated engine waits.
    pub = KvEventPublisher("w")
    for i in range(10):
        pub.publish([stored(10 * i, 4, parent=None)])
    blocks = list(pub.state._blocks.values())
    assert len(blocks) == 40 and not any(gc.is_tracked(b) for b in blocks)
    assert len(pub._recent) == 10 and not any(gc.is_tracked(x) for x in pub._recent)
    pub.close()


def test_a_snapshot_rebuilds_the_index_in_bounded_batches():
    pub = KvEventPublisher("w", buffer_size=0)
    fed = KvIndexer(64)
    for chain in range(30):  # 30 chains of 100 blocks of 64 tokens: 192k tokens
        event = BlockStored.from_token_ids(block_hashes=[chain * 1000 + i for i in range(100)], parent_hash=None,
                                           token_ids=[(chain * 7 + t) % 5000 for t in range(6400)], block_size=64)
        pub.publish([event])
        fed.apply(WorkerKey("w"), event)
    batches = batches_of(pub.replay(-1))
    assert len(batches) >= 3
    assert all(sum(e.num_tokens for e in b.events) <= SNAPSHOT_BATCH_TOKENS + 64 * 100 for b in batches)
    rebuilt = KvIndexer(64)
    for b in batches:
        for e in b.events:
            rebuilt.apply(WorkerKey("w"), e, b.lora_name)
    assert rebuilt._engine_to_router == fed._engine_to_router and rebuilt._refs == fed._refs
    pub.close()


def test_a_removed_parent_is_kept_for_its_cached_children():
    # Routers keep a child they placed after its parent goes; a snapshot must say the same.
    pub = KvEventPublisher("w", buffer_size=0)
    pub.publish([stored(1, 2)])
    pub.publish([stored(3, 1, parent=2)])
    pub.publish([BlockRemoved(block_hashes=[1, 2])])
    events = [e for b in batches_of(pub.replay(-1)) for e in b.events]
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [1, 2, 3] and events[1].block_hashes == [1, 2]
    pub.publish([BlockRemoved(block_hashes=[3])])  # the last child goes: so do its ancestors
    assert batches_of(pub.replay(-1)) == [] and len(pub.state) == 0
    pub.close()


@pytest.fixture
async def replay_server():
    pub = KvEventPublisher("w")
    pub.publish([stored(1, 2)])
    server = RequestPlaneServer()
    serve_kv_replay(server, [pub])
    await server.start()
    client = RequestPlaneClient()
    yield server.address, client
    await client.close()
    await server.stop()
    pub.close()


async def ask(client, address, request):
    return [c async for c in client.stream(address, KV_EVENTS_REPLAY, request, KvReplayChunk)]


async def test_the_endpoint_answers_and_bad_requests_get_error_replies(replay_server):
    address, client = replay_server
    answer = await ask(client, address, KvReplayRequest(after_event_id=-1))
    assert [(c.snapshot, c.event_id, len(c.batches)) for c in answer] == [(False, 0, 1)]
    with pytest.raises(RemoteError, match="DecodeError: undecodable KvReplayRequest"):
        await ask(client, address, msgspec.Raw(b"\xc1"))  # not msgpack at all
    with pytest.raises(RemoteError, match="DecodeError: invalid KvReplayRequest.*after_event_id"):
        await ask(client, address, {"dp_rank": 0})
    with pytest.raises(RemoteError, match="no KV event publisher for dp rank 5"):
        await ask(client, address, KvReplayRequest(after_event_id=-1, dp_rank=5))
    # The worker is unharmed.
    assert (await ask(client, address, KvReplayRequest(after_event_id=0)))[0].event_id == 0

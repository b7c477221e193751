"""The frontend's KV event intake: events reach the index in order, gaps are counted,
departed workers are dropped, bad events are rejected loudly."""

from __future__ import annotations

import asyncio

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import AllBlocksCleared, BlockStored, KvEventBatch
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.worker.kv_publisher import KvEventPublisher

BS = 4
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


def card(instance_id: str, address: str | None, block_size: int = BS) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=100, kv_block_size=block_size, total_kv_blocks=10,
                     max_num_seqs=1, max_num_batched_tokens=10, kv_events_address=address)


def stored(ids=(1, 2)) -> BlockStored:
    return BlockStored.from_token_ids(block_hashes=list(ids), parent_hash=None, token_ids=TOKENS[:len(ids) * BS],
                                      block_size=BS)


async def test_events_from_a_real_publisher_reach_the_index(caplog):
    index = KvIndexer(BS)
    consumer = KvEventsConsumer(index)
    pub = KvEventPublisher("w1")
    consumer.sync({"w1": card("w1", pub.address)})
    hashes = block_hashes(TOKENS, BS)
    try:
        # PUB/SUB needs a moment to connect: publish until the first batch lands.
        for _ in range(100):
            pub.publish([stored()])
            await asyncio.sleep(0.02)
            if index.find_matches(hashes):
                break
        assert index.find_matches(hashes) == {WorkerKey("w1"): 2}
        pub.publish([AllBlocksCleared()])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not index.find_matches(hashes):
                break
        assert index.find_matches(hashes) == {}
    finally:
        consumer.close()
        pub.close()


async def test_gaps_unknown_workers_and_departures(caplog):
    index = KvIndexer(BS)
    consumer = KvEventsConsumer(index)
    consumer.sync({"w1": card("w1", "tcp://127.0.0.1:1")})
    consumer.apply(KvEventBatch(instance_id="w1", event_id=0, events=[stored()]))
    consumer.apply(KvEventBatch(instance_id="w1", event_id=3, events=[]))
    assert consumer.gaps == 1 and "KV events 1..2 were missed" in caplog.text
    consumer.apply(KvEventBatch(instance_id="stranger", event_id=0, events=[stored()]))
    assert index.workers() == [WorkerKey("w1")]
    consumer.sync({})  # w1 left discovery: its blocks go
    assert index.find_matches(block_hashes(TOKENS, BS)) == {}
    consumer.close()


async def test_missing_publisher_and_block_size_mismatch_are_named(caplog):
    consumer = KvEventsConsumer(KvIndexer(BS))
    consumer.sync({"quiet": card("quiet", None), "odd": card("odd", "tcp://127.0.0.1:1", block_size=8)})
    assert "worker quiet publishes no KV events" in caplog.text
    assert "worker odd uses KV block size 8" in caplog.text
    consumer.close()


async def test_decode_workers_are_neither_followed_nor_warned_about(caplog):
    import msgspec

    consumer = KvEventsConsumer(KvIndexer(BS))
    decode = msgspec.structs.replace(card("dec", None), disaggregation_mode="decode")
    decode_with_load = msgspec.structs.replace(card("dec2", "tcp://127.0.0.1:1"), disaggregation_mode="decode")
    consumer.sync({"dec": decode, "dec2": decode_with_load})
    assert "publishes no KV events" not in caplog.text  # they get KV handed to them, by design
    assert not consumer._address_of
    consumer.close()

"""vLLM's KV events as the relay republishes them: stored blocks' token ids packed for the wire."""

from __future__ import annotations

import asyncio

import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from turbine.router.hashing import block_hashes  # noqa: E402
from turbine.router.indexer import KvIndexer, WorkerKey  # noqa: E402
from turbine.vllm.kv_events_relay import VllmKvEventsRelay, engine_hash, translate  # noqa: E402

BS = 4
TOKENS = [11, 12, 13, 14, 70_000, 49_151, 0, 7]


def vllm_stored(hashes, parent, tokens) -> object:
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                   lora_id=None, medium="GPU", lora_name=None)


def test_stored_blocks_are_relayed_with_packed_tokens_the_router_hashes_like_a_prompt():
    ours = translate(vllm_stored([b"\x01" * 32, 2], None, TOKENS))
    assert isinstance(ours, BlockStored)
    assert ours.block_hashes == [engine_hash(b"\x01" * 32), 2] and ours.parent_hash is None
    assert ours.tokens == b"".join(t.to_bytes(4, "little") for t in TOKENS) and ours.token_ids == TOKENS
    index = KvIndexer(BS)
    index.apply(WorkerKey("w"), ours)
    index.apply(WorkerKey("w"), translate(vllm_stored([3], 2, [1, 2, 3, 4])))
    assert index.find_matches(block_hashes(TOKENS + [1, 2, 3, 4], BS)) == {WorkerKey("w"): 3}


def test_blocks_keyed_by_more_than_tokens_are_not_relayed():
    """A prompt-embeddings request's blocks carry placeholder token ids and the embeddings' digest
    as extra keys: relayed as tokens they would read as a prompt of zeros."""
    embeds = vllm_stored([1, 2], None, [0] * 8)
    embeds.extra_keys = [(b"digest-1",), (b"digest-2",)]
    assert translate(embeds) is None
    plain = vllm_stored([1], None, TOKENS[:4])
    plain.extra_keys = [None]
    assert isinstance(translate(plain), BlockStored)


def test_an_adapters_blocks_are_relayed_its_name_being_their_only_extra_key():
    """vLLM lists a LoRA request's adapter name first in each block's extra keys; the relay sends
    the name as the batch's lora_name (routers salt their hashes with it)."""
    lora = vllm_events.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:4], block_size=BS,
                                   lora_id=3, medium="GPU", lora_name="sql", extra_keys=[("sql",)])
    assert isinstance(translate(lora), BlockStored)
    salted = vllm_events.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:4], block_size=BS,
                                     lora_id=3, medium="GPU", lora_name="sql", extra_keys=[("sql", "salt")])
    assert translate(salted) is None


def test_removals_and_clears_are_relayed():
    assert translate(vllm_events.BlockRemoved(block_hashes=[5, b"\x02"], medium="GPU")) == BlockRemoved(
        block_hashes=[5, engine_hash(b"\x02")])
    assert translate(vllm_events.AllBlocksCleared()) == AllBlocksCleared()


class RecordingPlane:
    """The event plane's publishing side, keeping what it was given."""

    address = "tcp://127.0.0.1:1"

    def __init__(self):
        self.sent: list[bytes] = []

    def publish_bytes(self, topic: str, data: bytes) -> None:
        self.sent.append(data)


@pytest.mark.parametrize("chosen", [False, True], ids=["any-port", "kv-events-port"])
async def test_each_data_parallel_rank_is_relayed_by_its_own_publisher(chosen):
    """vLLM's own publishers for ranks 0 and 1 (rank r connects to the endpoint's port + r), on a free run
    of ports or from the one --kv-events-port gives."""
    import asyncio

    from turbine.protocol.kv_events import KvEventBatch
    from turbine.runtime.codec import decode
    from turbine.runtime.ports import free_port
    from turbine.worker.kv_publisher import KvEventPublisher
    from turbine.vllm.kv_events_relay import VllmKvEventsRelay

    plane = RecordingPlane()
    port = free_port() if chosen else None
    relay = VllmKvEventsRelay([KvEventPublisher("w", dp_rank=r, events_plane=plane) for r in range(2)], port=port)
    if chosen:
        assert relay.engine_endpoint == f"tcp://127.0.0.1:{port}"
    await relay.listen(wait_s=0)
    task = asyncio.create_task(relay.run())
    engines = [vllm_events.ZmqEventPublisher(data_parallel_rank=r, endpoint=relay.engine_endpoint) for r in range(2)]
    try:
        await asyncio.sleep(0.5)  # zmq subscriptions settle
        for rank, engine in enumerate(engines):
            for i in range(2):
                engine.publish(vllm_events.KVEventBatch(ts=0.0, events=[
                    vllm_stored([100 * rank + i], None, [rank, i, 0, 0])]))
        for _ in range(50):
            if len(plane.sent) == 4:
                break
            await asyncio.sleep(0.1)
        batches = [decode(data, KvEventBatch) for data in plane.sent]
        by_rank = {r: [(b.event_id, b.events[0].block_hashes) for b in batches if b.dp_rank == r] for r in (0, 1)}
        assert by_rank == {0: [(0, [0]), (1, [1])], 1: [(0, [100]), (1, [101])]}  # ids counted per rank
        relay.cleared()
        assert {decode(d, KvEventBatch).dp_rank for d in plane.sent[4:]} == {0, 1}
    finally:
        for engine in engines:
            engine.shutdown()
        task.cancel()
        relay.close()


def test_the_relays_own_port_lies_below_the_ephemeral_range():
    """A checkpointed worker's relay binds its port again after the restore: a port of the ephemeral range
    could meanwhile be some outgoing connection's local port (seen on a GPU host), one below it cannot."""
    from turbine.runtime.ports import _ephemeral_range
    from turbine.vllm.kv_events_relay import VllmKvEventsRelay

    low, high = _ephemeral_range()
    for ranks in (1, 3):
        relay = VllmKvEventsRelay(ranks=ranks)
        try:
            assert not any(low <= p <= high for p in range(relay.port, relay.port + ranks)), relay.port
        finally:
            relay.close()


async def test_a_relay_closed_for_a_checkpoint_listens_again_and_the_engine_reconnects():
    """Checkpoint mode: the relay's port is chosen before the engine exists and bound once it is built, its
    publishers given later; quiesced, it closes its socket (none of ours in the image); after the restore
    it binds the same port again, waits for the engine's publisher to reconnect, and relays what it publishes."""
    import asyncio

    from turbine.worker.kv_publisher import KvEventPublisher
    from turbine.vllm.kv_events_relay import VllmKvEventsRelay

    relay = VllmKvEventsRelay(ranks=1)
    engine = vllm_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=relay.engine_endpoint)
    plane = RecordingPlane()
    task = None
    try:
        assert await relay.listen()  # the engine's publisher connects
        relay.unbind()
        await asyncio.sleep(0.3)  # the engine's publisher lost its peer and retries
        relay.attach([KvEventPublisher("restored", dp_rank=0, events_plane=plane)])
        assert await relay.listen()
        task = asyncio.create_task(relay.run())
        for _ in range(50):  # (the subscription reaches the publisher just after the connection)
            engine.publish(vllm_events.KVEventBatch(ts=0.0, events=[vllm_stored([7], None, [1, 2, 3, 4])]))
            await asyncio.sleep(0.1)
            if plane.sent:
                break
        assert plane.sent
    finally:
        engine.shutdown()
        if task is not None:
            task.cancel()
        relay.close()


async def test_an_engine_core_forked_while_the_engine_is_built_holds_no_socket_of_the_relay():
    """On a GPU vLLM forks its engine core while the engine is built; a forked child keeps a copy of every
    socket its parent has open, so a relay listening before the build could not listen again after a
    checkpoint's restore while the engine core lives ("Address already in use" on an H200). The relay binds
    only once the engine is built."""
    import multiprocessing
    import time

    from turbine.vllm.kv_events_relay import VllmKvEventsRelay

    relay = VllmKvEventsRelay(ranks=2)
    engine_core = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    engine_core.start()  # the engine being built
    try:
        await relay.listen(wait_s=0)
        relay.unbind()  # quiesced for the checkpoint
        await relay.listen(wait_s=0)  # the restore: binds again while the engine core lives
    finally:
        engine_core.kill()
        engine_core.join()
        relay.close()


def test_the_kvbm_tiers_events_are_relayed_with_their_tier_and_router_hashes():
    """--connector kvbm publishes its consolidated stream through vLLM (medium "turbine.kvbm/<tier>"):
    the relay gives them their tier; the hashes are already the router's, so the index takes them as they are."""
    from turbine.vllm.kvbm_connector import MEDIUM_PREFIX

    hashes = block_hashes(TOKENS, BS)
    stored = vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=BS,
                                     lora_id=None, medium=MEDIUM_PREFIX + "disk", lora_name=None)
    ours = translate(stored)
    assert isinstance(ours, BlockStored) and ours.tier == "disk" and ours.block_hashes == hashes
    removed = translate(vllm_events.BlockRemoved(block_hashes=hashes[:1], medium=MEDIUM_PREFIX + "disk"))
    assert isinstance(removed, BlockRemoved) and removed.tier == "disk" and removed.block_hashes == hashes[:1]
    index = KvIndexer(BS)
    index.apply(WorkerKey("w"), ours)
    assert index.tier_matches(hashes, [WorkerKey("w")], {}) == {WorkerKey("w"): ["disk", "disk"]}
    # The engine's own events keep no tier; an unknown medium of ours is not a tier either.
    assert translate(vllm_stored([2], None, TOKENS[:BS])).tier is None
    odd = vllm_events.BlockRemoved(block_hashes=[1], medium=MEDIUM_PREFIX + "tape")
    assert translate(odd).tier is None


def test_a_taken_kv_events_port_is_named():
    import socket

    from turbine.runtime.errors import EventPlaneError
    from turbine.worker.kv_publisher import KvEventPublisher
    from turbine.vllm.kv_events_relay import VllmKvEventsRelay

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EventPlaneError, match=f"--kv-events-port {port}: cannot bind 127.0.0.1:{port}"):
            VllmKvEventsRelay([KvEventPublisher("w", dp_rank=0, events_plane=RecordingPlane())], port=port)


class _BuiltWith:
    """Stands in for AsyncLLM.from_engine_args: keeps the engine arguments the worker built it with."""

    args = None

    @classmethod
    def from_engine_args(cls, engine_args, stat_loggers=None):
        cls.args = engine_args
        return object()


@pytest.mark.parametrize("flags,publishes", [([], True), (["--no-kv-events"], False)])
def test_no_kv_events_gives_the_engine_no_publisher_and_the_worker_no_relay(monkeypatch, flags, publishes):
    import contextlib

    from turbine.vllm import worker
    from turbine.vllm.args import parse_worker_args

    monkeypatch.setattr(worker, "AsyncLLM", _BuiltWith)
    monkeypatch.setattr(worker, "engine_cores_forked", lambda *a: contextlib.nullcontext())

    async def listened(self, wait_s=5.0):
        return True
    monkeypatch.setattr(VllmKvEventsRelay, "listen", listened)
    engine = worker.VllmEngine(parse_worker_args(["--enforce-eager", *flags]))
    asyncio.run(engine.build(checkpoint=False))
    assert (engine.relay is not None) == publishes
    config = _BuiltWith.args.kv_events_config
    assert (config is not None and config.enable_kv_cache_events) == publishes


def test_no_kv_events_refuses_what_only_events_use(capsys):
    from turbine.vllm.args import parse_worker_args

    assert parse_worker_args([]).kv_events and not parse_worker_args(["--no-kv-events"]).kv_events
    for extra in (["--kv-events-port", "20080"], ["--kv-events-buffer", "64"]):
        with pytest.raises(SystemExit):
            parse_worker_args(["--no-kv-events", *extra])
        assert "--no-kv-events" in capsys.readouterr().err

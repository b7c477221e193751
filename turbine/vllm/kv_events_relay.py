"""Relays the vLLM engine's own KV cache events to Turbine's event plane.

vLLM publishes msgpack KV event batches over zmq (KVEventsConfig); its publisher connects
when its endpoint names a host, so the relay binds a SUB socket on loopback and hands vLLM
that address. Each vLLM batch is decoded with vLLM's own typed structs (never unpickled) and
republished as a numbered Turbine KvEventBatch.

With data parallelism each rank's engine publishes on the endpoint's port + its rank, so the
relay binds a run of consecutive ports, one per rank, and republishes each rank's batches
through that rank's own publisher (own event ids, own replay buffer and cache state).
"""

from __future__ import annotations

import logging

import msgspec
import xxhash
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, pack_token_ids
from turbine.worker.kv_publisher import KvEventPublisher

log = logging.getLogger("turbine.vllm")

_decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)


def engine_hash(h: bytes | int) -> int:
    """vLLM's block hashes are ints or bytes (e.g. sha256): opaque ids, mapped to 64 bits."""
    return h if isinstance(h, int) else xxhash.xxh3_64_intdigest(h)


def translate(event) -> KvEvent | None:
    """Ours for one of vLLM's events (None: a kind we do not relay). vLLM gives a stored block's
    token ids as a list; they are packed here, once (OverflowError / TypeError if they are not
    u32 token ids)."""
    if isinstance(event, vllm_events.BlockStored):
        if any(_beyond_lora(keys, event.lora_name) for keys in event.extra_keys or ()):
            # Blocks keyed by more than their tokens and adapter (prompt embeddings, whose token
            # ids are placeholders; media; a cache salt): a router hashing token ids would take
            # them for another prompt. Not relayed; blocks stored under them then have an unknown
            # parent. The adapter is relayed as the batch's lora_name, which salts routers' hashes.
            return None
        return BlockStored(block_hashes=[engine_hash(h) for h in event.block_hashes],
                           parent_hash=None if event.parent_block_hash is None
                           else engine_hash(event.parent_block_hash),
                           tokens=pack_token_ids(event.token_ids), block_size=event.block_size)
    if isinstance(event, vllm_events.BlockRemoved):
        return BlockRemoved(block_hashes=[engine_hash(h) for h in event.block_hashes])
    if isinstance(event, vllm_events.AllBlocksCleared):
        return AllBlocksCleared()
    return None


def _beyond_lora(keys, lora_name: str | None) -> bool:
    """Whether a block's extra keys hold more than its adapter's name (vLLM lists it first)."""
    if not keys:
        return False
    if lora_name is not None and keys[0] == lora_name:
        keys = keys[1:]
    return bool(keys)


class VllmKvEventsRelay:
    def __init__(self, publishers: list[KvEventPublisher]):
        """`publishers[r]` republishes data-parallel rank r's events."""
        assert [p.dp_rank for p in publishers] == list(range(len(publishers)))
        self.publishers = publishers
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        port = _bind_port_run(self._sock, len(publishers))
        self.engine_endpoint = f"tcp://127.0.0.1:{port}"  # what vLLM's publisher (rank 0) connects to

    @property
    def publisher(self) -> KvEventPublisher:
        """Rank 0's: its event plane (shared by every rank) is where subscribers connect."""
        return self.publishers[0]

    def engine_config(self):
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.engine_endpoint)

    async def run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                batch = _decoder.decode(frames[-1])  # frames: topic, sequence number, payload
            except msgspec.DecodeError as exc:
                log.warning("undecodable KV event batch from the engine dropped: %s", exc)
                continue
            rank = batch.data_parallel_rank or 0
            if rank >= len(self.publishers):
                log.warning("KV events of data-parallel rank %d dropped: this worker relays ranks 0..%d",
                            rank, len(self.publishers) - 1)
                continue
            by_lora: dict[str | None, list[KvEvent]] = {}
            for event in batch.events:
                try:
                    ours = translate(event)
                except (OverflowError, TypeError) as exc:  # never from a sane engine; must not stop the relay
                    log.warning("KV event from the engine dropped: its token ids do not fit u32 (%s)", exc)
                    continue
                if ours is not None:
                    by_lora.setdefault(getattr(event, "lora_name", None), []).append(ours)
            for lora_name, events in by_lora.items():
                self.publishers[rank].publish(events, lora_name=lora_name)

    def cleared(self) -> None:
        """The worker reset the prefix cache: tell subscribers now, not at the engine's next step."""
        for publisher in self.publishers:
            publisher.publish([AllBlocksCleared()])

    def close(self) -> None:
        self._sock.close()


def _bind_port_run(sock, count: int, attempts: int = 50) -> int:
    """Binds `sock` on loopback ports P..P+count-1 (vLLM offsets each rank's port by its rank)."""
    for _ in range(attempts):
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        bound = [port]
        try:
            for p in range(port + 1, port + count):
                sock.bind(f"tcp://127.0.0.1:{p}")
                bound.append(p)
            return port
        except zmq.ZMQError:
            for p in bound:
                sock.unbind(f"tcp://127.0.0.1:{p}")
    raise RuntimeError(f"no run of {count} free loopback ports for the KV events relay")

"""Relays the vLLM engine's own KV cache events to Turbine's event plane.

vLLM publishes msgpack KV event batches over zmq (KVEventsConfig); its publisher connects
when its endpoint names a host, so the relay binds a SUB socket on loopback and hands vLLM
that address. Each vLLM batch is decoded with vLLM's own typed structs (never unpickled) and
republished as a numbered Turbine KvEventBatch.

With data parallelism each rank's engine publishes on the endpoint's port + its rank, so the
relay binds a run of consecutive ports, one per rank, and republishes each rank's batches
through that rank's own publisher (own event ids, own replay buffer and cache state). The run
starts at --kv-events-port when given (a firewall or a port plan may want it known), else
wherever a run is free.

The `--connector kvbm` tiers' consolidated events come the same way (vLLM publishes a connector's
`take_events` with the engine's): their `medium` is "turbine.kvbm/<tier>", and they are relayed as
events with that `tier` whose hashes are already the router's (turbine.protocol.kv_events).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import xxhash
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from turbine.protocol.kv_events import TIERS, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, pack_token_ids
from turbine.router.hashing import media_key
from turbine.runtime.errors import EventPlaneError
from turbine.runtime.ports import claim_port_run, is_free
from turbine.worker.kv_publisher import KvEventPublisher

log = logging.getLogger("turbine.vllm")

_decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)


def engine_hash(h: bytes | int) -> int:
    """vLLM's block hashes are ints or bytes (e.g. sha256): opaque ids, mapped to 64 bits."""
    return h if isinstance(h, int) else xxhash.xxh3_64_intdigest(h)


KVBM_MEDIUM = "turbine.kvbm/"  # turbine.vllm.kvbm_connector.MEDIUM_PREFIX (that module imports torch)


def _tier(event) -> str | None:
    medium = getattr(event, "medium", None)
    if medium and medium.startswith(KVBM_MEDIUM) and medium[len(KVBM_MEDIUM):] in TIERS:
        return medium[len(KVBM_MEDIUM):]
    return None


def translate(event) -> KvEvent | None:
    """Ours for one of vLLM's events (None: a kind we do not relay). vLLM gives a stored block's
    token ids as a list; they are packed here, once (OverflowError / TypeError if they are not
    u32 token ids). A block holding image placeholder tokens gets its media key (the images'
    identifiers and offsets from vLLM's extra keys: the key the frontend computes for it)."""
    if (tier := _tier(event)) is not None:
        hashes = [h for h in event.block_hashes if isinstance(h, int)]  # router hashes, u64
        if isinstance(event, vllm_events.BlockStored):
            return BlockStored(block_hashes=hashes, parent_hash=None, tokens=b"", block_size=event.block_size,
                               tier=tier)
        return BlockRemoved(block_hashes=hashes, tier=tier)
    if isinstance(event, vllm_events.BlockStored):
        media_keys = None
        if event.extra_keys:
            media = [_media_items(keys, event.lora_name) for keys in event.extra_keys]
            if any(items is None for items in media):
                # Blocks keyed by more than their tokens, adapter and images (prompt embeddings, whose
                # token ids are placeholders; a cache salt): a router hashing token ids would take them
                # for another prompt. Not relayed; blocks stored under them then have an unknown parent.
                # The adapter is relayed as the batch's lora_name, which salts routers' hashes.
                return None
            media_keys = [media_key(items) for items in media]
            if not any(media_keys):
                media_keys = None
        return BlockStored(block_hashes=[engine_hash(h) for h in event.block_hashes],
                           parent_hash=None if event.parent_block_hash is None
                           else engine_hash(event.parent_block_hash),
                           tokens=pack_token_ids(event.token_ids), block_size=event.block_size,
                           media_keys=media_keys)
    if isinstance(event, vllm_events.BlockRemoved):
        return BlockRemoved(block_hashes=[engine_hash(h) for h in event.block_hashes])
    if isinstance(event, vllm_events.AllBlocksCleared):
        return AllBlocksCleared()
    return None


def _media_items(keys, lora_name: str | None) -> list[tuple[str, int]] | None:
    """A block's image (identifier, offset) pairs from its extra keys, which list the adapter's name first
    (if any), then the images' pairs, then a cache salt or prompt-embedding digests (None: such keys)."""
    if not keys:
        return []
    if lora_name is not None and keys[0] == lora_name:
        keys = keys[1:]
    items = []
    for key in keys:
        if not (isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], int) and not isinstance(key[1], bool)):
            return None
        items.append((key[0], key[1]))
    return items


class VllmKvEventsRelay:
    def __init__(self, publishers: list[KvEventPublisher] | None = None, port: int | None = None,
                 host: str = "127.0.0.1", ranks: int | None = None):
        """`publishers[r]` republishes data-parallel rank r's events (None: given later with `attach`, then
        `ranks` says how many); `port`: the first port of the run (--kv-events-port; None: any free run).
        EventPlaneError naming the flag if it is taken. `host`: where it listens (loopback, or the
        data-parallel address when ranks run on other nodes)."""
        self.ranks = len(publishers) if publishers is not None else ranks
        assert self.ranks, "publishers or ranks"
        self.publishers: list[KvEventPublisher] = []
        if publishers is not None:
            self.attach(publishers)
        self.host = host
        # The ports are chosen (or the given ones checked) now, for the engine's config, but bound only by
        # listen(), once the engine is built: on a GPU vLLM forks its engine core, and a forked child keeps
        # a copy of every listening socket of ours, so a socket closed for a checkpoint could not be bound
        # again after the restore ("Address already in use", gpu_tests.sh lifecycle on an H200).
        self._sock = None
        if port is None:  # claimed (locked for this process) until it is bound: no other worker here takes it
            port = claim_port_run(host, self.ranks, "the KV events relay")
        else:
            _check_given_run(port, self.ranks, host)
        self.port = port
        self.engine_endpoint = f"tcp://{host}:{port}"  # what vLLM's publisher (rank 0) connects to

    @staticmethod
    def _socket():
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def attach(self, publishers: list[KvEventPublisher]) -> None:
        assert [p.dp_rank for p in publishers] == list(range(self.ranks))
        self.publishers = publishers

    async def listen(self, wait_s: float = 5.0) -> bool:
        """Bind the chosen ports (once the engine is built, and again after a restore), then wait up to
        `wait_s` for the engine's publisher to connect, so that the first request's events are not lost:
        True once it has. EventPlaneError naming the flag if a port was taken meanwhile."""
        deadline = time.monotonic() + 2.0
        while True:
            sock = self._socket()
            monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED)
            try:
                _bind_given_run(sock, self.port, self.ranks, self.host)
                break
            except EventPlaneError:
                monitor.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)  # a zmq socket just closed (unbind) is closed by its I/O thread, soon
        self._sock = sock
        try:
            async with asyncio.timeout(wait_s):
                await monitor.recv_multipart()
            return True
        except TimeoutError:
            return False
        finally:
            sock.disable_monitor()
            monitor.close()

    def unbind(self) -> None:
        """Close the listening socket (checkpoint mode: no socket of ours in the image); the engine's
        publisher keeps trying to reconnect, and what it publishes meanwhile is lost (nothing is
        routed to a quiesced engine)."""
        self._sock.close()
        self._sock = None

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
        if self._sock is not None:
            self._sock.close()


def _bind_given_run(sock, port: int, count: int, host: str = "127.0.0.1") -> None:
    for p in range(port, port + count):
        try:
            sock.bind(f"tcp://{host}:{p}")
        except zmq.ZMQError as exc:
            sock.close()
            ports = f"{port}" if count == 1 else f"{port}-{port + count - 1} (one per data-parallel rank)"
            raise EventPlaneError(f"--kv-events-port {port}: cannot bind {host}:{p} of {ports}: {exc}") from None


def _check_given_run(port: int, count: int, host: str = "127.0.0.1") -> None:
    """--kv-events-port's run is free now: refused by the flag's name at start, not once the engine is built."""
    if (taken := next((p for p in range(port, port + count) if not is_free(host, p)), None)) is not None:
        ports = f"{port}" if count == 1 else f"{port}-{port + count - 1} (one per data-parallel rank)"
        raise EventPlaneError(f"--kv-events-port {port}: cannot bind {host}:{taken} of {ports}: Address already in use")

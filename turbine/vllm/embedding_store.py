"""Image embeddings between an encode worker and the engines that take them: the file format, the encode
worker's byte-bounded LRU cache, and the two NIXL ends (host memory).

A file (the `file` transport) is: the magic b"TEMB", a little-endian u32 header length, a msgpack header
{"hash", "dtype", "shape"}, then the raw values, row-major. A NIXL buffer (the `nixl` transport) is the raw
values alone; its header (dtype, shape) travels in the ImageEmbedding the encode worker answered with. The
reader checks the header against what it was told (hash, dtype, shape, byte length) before it takes a value:
nothing is unpickled, a mismatch is an EmbeddingUnavailable naming the image."""

from __future__ import annotations

import logging
import math
import os
import struct
import time
from collections import OrderedDict

import msgspec
import torch

from turbine.protocol.generate import ImageEmbedding, NixlSource

log = logging.getLogger("turbine.vllm")

MAGIC = b"TEMB"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
# A NIXL buffer handed out stays registered (and an evicted file stays on disk) this long after eviction at
# least, so a consumer that was told where it is can still read it.
HANDOUT_GRACE_S = 60.0


class EmbeddingUnavailable(Exception):
    pass


def nbytes_of(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()


def check_location(e: ImageEmbedding) -> None:
    """The typed header's own sense (before any read): a known dtype, a 2-D shape, one transport."""
    if e.dtype not in DTYPES:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: embedding dtype {e.dtype!r} is not one of {', '.join(DTYPES)}")
    if len(e.shape) != 2 or min(e.shape) <= 0:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: embedding shape {e.shape} is not (tokens, hidden)")
    if (e.path is None) == (e.nixl is None):
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: exactly one of a path and a NIXL source is expected")
    if e.nixl is not None and e.nixl.length != nbytes_of(e.dtype, e.shape):
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: NIXL buffer of {e.nixl.length} bytes for {e.shape} {e.dtype}")


def write_file(path: str, image_hash: str, tensor: torch.Tensor) -> None:
    """Write atomically (a reader never sees half a file)."""
    header = msgspec.msgpack.encode({"hash": image_hash, "dtype": NAMES[tensor.dtype], "shape": list(tensor.shape)})
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(_raw(tensor))
    os.replace(tmp, path)


def read_file(e: ImageEmbedding) -> torch.Tensor:
    check_location(e)
    try:
        with open(e.path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: cannot read {e.path}: {exc}") from None
    if data[:4] != MAGIC or len(data) < 8:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: {e.path} is not an embedding file")
    (size,) = struct.unpack("<I", data[4:8])
    try:
        header = msgspec.msgpack.decode(data[8:8 + size], type=dict[str, object])
    except msgspec.DecodeError as exc:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: {e.path}: bad header: {exc}") from None
    told = {"hash": e.hash, "dtype": e.dtype, "shape": list(e.shape)}
    if header != told:
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: {e.path} holds {header}, expected {told}")
    body = data[8 + size:]
    if len(body) != nbytes_of(e.dtype, e.shape):
        raise EmbeddingUnavailable(f"image {e.hash[:16]}: {e.path} has {len(body)} bytes of values, expected "
                                   f"{nbytes_of(e.dtype, e.shape)}")
    return _from_raw(bytearray(body), e.dtype, e.shape)


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def _from_raw(buf: bytearray, dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[dtype]).reshape(shape)


class _Entry:
    __slots__ = ("tensor", "nbytes", "path", "nixl_reg")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.path: str | None = None
        self.nixl_reg = None  # NIXL registration of tensor's memory


class EmbeddingCache:
    """The encode worker's embeddings by image hash, least recently used first out past `capacity_bytes`.
    An entry's file and NIXL registration go with it, `HANDOUT_GRACE_S` after its eviction."""

    def __init__(self, capacity_bytes: int, file_dir: str, nixl: NixlServer | None = None):
        self.capacity = capacity_bytes
        self.file_dir = file_dir
        self.nixl = nixl
        self.bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._evicted: list[tuple[float, _Entry]] = []  # (when, entry), released after the grace period

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_hash: str) -> torch.Tensor | None:
        entry = self._entries.get(image_hash)
        if entry is None:
            return None
        self._entries.move_to_end(image_hash)
        return entry.tensor

    def put(self, image_hash: str, tensor: torch.Tensor) -> None:
        if image_hash in self._entries:
            self._entries.move_to_end(image_hash)
            return
        entry = _Entry(tensor)
        self._entries[image_hash] = entry
        self.bytes += entry.nbytes
        # Evict down to the bound; the newest stays even when it alone is larger (it is being answered with).
        while self.bytes > self.capacity and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self._evicted.append((time.monotonic(), old))
        self.release_expired()

    def location(self, image_hash: str, transport: str) -> ImageEmbedding:
        """Where a consumer reads the cached embeddings of `image_hash` by `transport` (made on first ask)."""
        entry = self._entries[image_hash]
        tensor = entry.tensor
        common = {"hash": image_hash, "dtype": NAMES[tensor.dtype], "shape": list(tensor.shape)}
        if transport == "file":
            if entry.path is None:
                entry.path = os.path.join(self.file_dir, f"{image_hash}.temb")
                write_file(entry.path, image_hash, tensor)
            return ImageEmbedding(**common, path=entry.path)
        if self.nixl is None:
            raise EmbeddingUnavailable("this encode worker has no NIXL agent")
        if entry.nixl_reg is None:
            entry.nixl_reg = self.nixl.register(tensor)
        return ImageEmbedding(**common, nixl=self.nixl.source(tensor))

    def release_expired(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._evicted and now - self._evicted[0][0] >= HANDOUT_GRACE_S:
            _, entry = self._evicted.pop(0)
            self._release(entry)

    def close(self) -> None:
        for entry in [*self._entries.values(), *(e for _, e in self._evicted)]:
            self._release(entry)
        self._entries.clear()
        self._evicted.clear()

    def _release(self, entry: _Entry) -> None:
        if entry.path is not None:
            try:
                os.unlink(entry.path)
            except OSError:
                pass
        if entry.nixl_reg is not None and self.nixl is not None:
            self.nixl.deregister(entry.nixl_reg)


def _nixl_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread: it busy-polls a core (see nixl_cpu.py); each end polls when it needs to.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class NixlServer:
    """The encode worker's NIXL agent: registers cached embeddings' host memory for consumers to READ.
    UCX completes a read only while the target also makes progress, so `poll()` must run while reads may be
    in flight (the encode worker calls it on a timer after each hand-out; consumers notify when done)."""

    def __init__(self, name: str):
        self.name = name
        self.agent = _nixl_agent(name)
        self._metadata: bytes | None = None  # the agent's metadata, which lists its registered memory

    def register(self, tensor: torch.Tensor):
        self._metadata = None
        return self.agent.register_memory(self.agent.get_reg_descs(tensor))

    def deregister(self, reg) -> None:
        self._metadata = None
        try:
            self.agent.deregister_memory(reg)
        except Exception:  # noqa: BLE001 - closing anyway
            log.exception("NIXL deregister failed")

    def source(self, tensor: torch.Tensor) -> NixlSource:
        if self._metadata is None:
            self._metadata = self.agent.get_agent_metadata()
        return NixlSource(agent=self.name, metadata=self._metadata, address=tensor.data_ptr(),
                          length=tensor.numel() * tensor.element_size())

    def poll(self) -> int:
        """Progress the agent; returns how many consumers' done-notifications came."""
        notifs = self.agent.get_new_notifs()
        return sum(len(v) for v in notifs.values())


class NixlReader:
    """A consumer's NIXL agent (one per engine worker process): reads an encode worker's buffer into a new
    tensor, then tells the encode worker it is done (a notification)."""

    def __init__(self, name: str, timeout_s: float = 30.0):
        self.agent = _nixl_agent(name)
        self.timeout_s = timeout_s
        self._remotes: dict[str, bytes] = {}  # remote agent name -> the metadata it was added with

    def read(self, e: ImageEmbedding) -> torch.Tensor:
        check_location(e)
        src = e.nixl
        known = self._remotes.get(src.agent)
        if known != src.metadata:  # new, or its registered memory changed since
            if known is not None:
                self.agent.remove_remote_agent(src.agent)
            self.agent.add_remote_agent(src.metadata)
            self._remotes[src.agent] = src.metadata
        remote = src.agent
        out = torch.empty(e.shape, dtype=DTYPES[e.dtype])
        reg = self.agent.register_memory(self.agent.get_reg_descs(out))
        handle = None
        try:
            local = self.agent.get_xfer_descs(out)
            far = self.agent.get_xfer_descs([(src.address, src.length, 0)], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, far, remote, e.hash.encode())
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise EmbeddingUnavailable(f"image {e.hash[:16]}: NIXL read from {src.agent} timed out")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise EmbeddingUnavailable(f"image {e.hash[:16]}: NIXL read from {src.agent} failed")
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(reg)
        return out

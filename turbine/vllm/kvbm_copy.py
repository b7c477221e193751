"""Whole KV blocks between the engine's per-layer caches (CPU or GPU) and the tiers' payloads.

One payload format on every device: for each layer, in the engine's layer order, the block's slice of
the layer's cache in the attention backends' shared logical layout `(num_kv_heads, block_size,
2 × head_size)` (K and V packed in the last dimension), as raw bytes of the cache dtype, row-major.
vLLM's CPU backend and its GPU FlashAttention, FlashInfer, FlexAttention and Triton backends all give
their caches that logical shape `(num_blocks, H, N, 2D)`; they differ only in the order in memory (the
GPU's default NHD layout stores `(num_blocks, N, H, 2D)`), which the copies here go through, so a block a
CPU worker wrote is the same bytes a GPU worker of that model, dtype and block size reads. A cache of
another logical shape is refused at start, naming the layer.

- CPU: a save copies the blocks out at once (the next step may reuse them) and the payloads are views of
  that copy; a load copies into the cache before the forward pass.
- GPU: payloads live in slots of one pinned host allocation made at start (`PinnedSlots`: allocating
  pinned memory per save costs milliseconds and can stall the device). A save gathers the step's blocks on
  the GPU (one small copy kernel per layer, in stream order after the forward pass), then a side stream
  copies them into free slots while the next step runs; a writer thread waits for that copy and hands the
  slots to the tiers (the host tier keeps the slot itself; disk and shared tiers write it to a file: the disk tier
  through a writer process that maps the slots, `shared_slots`), so neither the D2H copy nor any file I/O is on the
  model runner's path. A slot is free again once nothing
  holds its payload (the host tier evicted it and no load reads it). With no free slot a save is dropped
  (counted, and the block is simply recomputed when needed), so a slow disk cannot grow memory without
  bound. A load copies each block host → GPU and scatters it into every layer, in stream order before the
  forward pass: from a slot by DMA. The file tiers read payloads straight into free slots (`read_buffer`: no copy
  between the file and the DMA, and the host tier keeps that slot when it promotes the block), leaving the saves a
  reserve; a payload in pageable memory (a read that found only the reserve free) goes through two pinned staging
  buffers of STAGE_ROWS blocks made at start, in turns (one filled while the other's DMA runs), as one pageable
  copy per block went at a fraction of DMA speed and pinning a buffer the size of a long prompt's load took seconds.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("turbine.vllm.kvbm")

# Slots beyond what the host tier holds: saves in flight between the D2H copy and the tiers.
PENDING_SAVE_BYTES = 1 << 30

# Blocks per pinned staging buffer of a load (two of them): 128 MiB each for the 2 MiB blocks of an 8B model.
STAGE_ROWS = 64

# (hash, parent hash, payload) → into the tiers
StoreBlocks = Callable[[list[tuple[int, int | None, memoryview]]], None]


class PinnedSlots:
    """Fixed-size slots of one host allocation (pinned where there is a GPU). `take` hands out free slots;
    `payload(slot)` is a byte view of one that frees the slot when the last reference to it goes.

    `shared`: the allocation is a memfd (`fd`, `nbytes`) that another process can map (the file writer process,
    turbine/kvbm/file_writer.py, reads payloads from it by `offset_of`), pinned by registering it with CUDA."""

    def __init__(self, slot_bytes: int, count: int, pinned: bool, shared: bool = False):
        self.nbytes = slot_bytes * count
        self.fd: int | None = None
        if shared:
            self.fd = os.memfd_create("turbine-kvbm-slots")
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(count, slot_bytes)
            if pinned:
                err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0))
                if err:
                    raise RuntimeError(f"--connector kvbm: pinning {self.nbytes} bytes of host slots failed "
                                       f"(cudaHostRegister error {err})")
        else:
            self.tensor = torch.empty((count, slot_bytes), dtype=torch.uint8, pin_memory=pinned)
        self._rows = self.tensor.numpy()
        self._free = collections.deque(range(count))
        self._lock = threading.Lock()

    def take(self, k: int, keep: int = 0) -> list[int] | None:
        """k free slots, or None when fewer than k + `keep` are free."""
        with self._lock:
            if len(self._free) < k + keep:
                return None
            return sorted(self._free.popleft() for _ in range(k))

    def payload(self, slot: int) -> memoryview:
        row = self._rows[slot]  # a view of its own, whose end returns the slot
        weakref.finalize(row, self._free.append, slot)
        return memoryview(row)

    def holds(self, data) -> bool:
        """Whether `data` is a payload view of one of these slots."""
        return isinstance(data, memoryview) and getattr(data.obj, "base", None) is self._rows

    def offset_of(self, data) -> int | None:
        """Where the payload view `data` starts in the allocation; None when it is not a slot's."""
        return data.obj.ctypes.data - self._rows.ctypes.data if self.holds(data) else None

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class _PendingSave:
    slots: list[int]
    done: torch.cuda.Event | None          # the D2H copy's completion (None: already copied)
    blocks: list[tuple[int, int | None]]   # (hash, parent hash) of each slot


class KvCacheBlocks:
    """The engine's KV caches seen as whole blocks: `save` after a forward pass, `load` before one."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], *, num_blocks: int, num_kv_heads: int,
                 block_size: int, head_size: int, store_blocks: StoreBlocks, host_tier_bytes: int = 0,
                 background: bool | None = None, pending_bytes: int | None = None, stage_loads: bool | None = None,
                 stage_rows: int = STAGE_ROWS, shared_slots: bool = False):
        """`store_blocks` puts payloads into the tiers. `background` (default: on a GPU) stores them on the
        writer thread, from slots sized for a host tier of `host_tier_bytes` plus `pending_bytes` in flight.
        `stage_loads` (default: on a GPU) copies a load's payloads that are not in a slot through the staging.
        `shared_slots`: the slots are memory another process can map (PinnedSlots' `shared`)."""
        expected = (num_blocks, num_kv_heads, block_size, 2 * head_size)
        for name, t in kv_caches.items():
            if tuple(t.shape) != expected:
                raise ValueError(f"--connector kvbm: layer {name}'s KV cache has the logical shape {tuple(t.shape)}, "
                                 f"not (blocks, kv heads, block size, 2 x head size) = {expected}: an attention "
                                 f"backend whose layout the tiers' block format does not cover")
        self.layers = list(kv_caches.values())
        self.device = self.layers[0].device
        self.block_nbytes = sum(t[0].numel() * t.element_size() for t in self.layers)
        self._store_blocks = store_blocks
        self._on_gpu = self.device.type == "cuda"
        self._held: list[object] = []  # what this step's loads read from, kept until the step is done
        self._stream = torch.cuda.Stream(device=self.device) if self._on_gpu else None
        # Two staging buffers for a load's pageable payloads, each free again once its last DMA is done.
        stage = self._on_gpu if stage_loads is None else stage_loads
        self._stage = [torch.empty((stage_rows, self.block_nbytes), dtype=torch.uint8, pin_memory=self._on_gpu)
                       for _ in range(2)] if stage else []
        self._stage_done: list[torch.cuda.Event | None] = [None, None]
        self.staged_loads = 0  # blocks loaded through the staging
        self.background = self._on_gpu if background is None else background
        self.dropped_saves = 0
        if self.background:
            pending = PENDING_SAVE_BYTES if pending_bytes is None else pending_bytes
            count = max(1, host_tier_bytes // self.block_nbytes + pending // self.block_nbytes)
            self.slots = PinnedSlots(self.block_nbytes, count, pinned=self._on_gpu, shared=shared_slots)
            # Reads from files take slots too (read_buffer) but leave this many to the saves in flight.
            self._save_reserve = pending // self.block_nbytes // 2
            log.info("kvbm: %d host slots of %d bytes (%.1f GiB%s)", count, self.block_nbytes,
                     count * self.block_nbytes / 2**30, ", pinned" if self._on_gpu else "")
            self._queue: queue.Queue[_PendingSave | threading.Event | None] = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kvbm-writer", daemon=True)
            self._writer.start()

    # ---- saves (after the forward pass)
    def save(self, blocks: list[tuple[int, int, int | None]]) -> None:
        """blocks: (engine block id, hash, parent hash). In the background, returns before they are stored."""
        if not blocks:
            return
        meta = [(h, parent) for _, h, parent in blocks]
        if not self.background:
            rows = self._gather([b[0] for b in blocks])
            self._store_blocks([(h, p, memoryview(rows[i].numpy())) for i, (h, p) in enumerate(meta)])
            return
        slots = self.slots.take(len(blocks))
        if slots is None:
            self.dropped_saves += 1
            if self.dropped_saves == 1 or self.dropped_saves % 1000 == 0:
                log.warning("kvbm: %d saves dropped: every host slot is held (the tiers' writer is behind, or "
                            "the host tier is full of blocks a load still reads)", self.dropped_saves)
            return
        rows = self._gather([b[0] for b in blocks])
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._into_slots(rows, slots)
                done.record(self._stream)
            rows.record_stream(self._stream)  # the gather buffer is the side stream's until its copy is done
        else:
            self._into_slots(rows, slots)
        self._queue.put(_PendingSave(slots, done, meta))

    def _into_slots(self, rows: torch.Tensor, slots: list[int]) -> None:
        """Row i into slot slots[i]; a run of consecutive slots is one copy."""
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            self.slots.tensor[slots[i]:slots[i] + (j - i)].copy_(rows[i:j], non_blocking=True)
            i = j

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """(k, block bytes) uint8 on the cache's device, in the payload format: each row one block."""
        idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        rows = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8, device=self.device)
        offset = 0
        for layer in self.layers:
            # index_select reads the logical order whatever the layout in memory, and returns it contiguous
            part = layer.index_select(0, idx).reshape(len(block_ids), -1).view(torch.uint8)
            rows[:, offset:offset + part.shape[1]].copy_(part)
            offset += part.shape[1]
        return rows

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # flush(): everything before it is stored
                item.set()
                continue
            try:
                self._store_pending(item)
            except Exception:  # a tier that fails must not stop later saves
                log.exception("kvbm: saving %d blocks failed", len(item.blocks))

    def _store_pending(self, item: _PendingSave) -> None:
        """(A call of its own: nothing of it outlives the call, so the tiers alone hold the payloads.)"""
        if item.done is not None:
            item.done.synchronize()
        # From here each slot belongs to its payload: free again when nothing holds it.
        payloads = [self.slots.payload(s) for s in item.slots]
        self._store_blocks([(h, p, payloads[i]) for i, (h, p) in enumerate(item.blocks)])

    def flush(self, timeout: float = 60.0) -> None:
        """Waits until every save made so far is in the tiers."""
        if self.background:
            done = threading.Event()
            self._queue.put(done)
            done.wait(timeout)

    def close(self) -> None:
        """Stores what is pending, then stops the writer."""
        if self.background and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=60)

    # ---- loads (before the forward pass)
    def _in_slot(self, data) -> bool:
        """Whether the payload is a view of a pinned slot (a save's kept by the host tier, or a file read's)."""
        return self.background and self.slots.holds(data)

    def read_buffer(self, nbytes: int) -> memoryview | None:
        """A free slot for a payload read from a file (the file tiers' reader threads call this): its load is then
        a DMA straight from there, and the host tier keeps the slot itself when the block is promoted. None where
        there are no slots (CPU), the size is not a block's, or only the saves' reserve is left (then the read
        goes to pageable bytes and its load through the staging)."""
        if not self.background or nbytes != self.block_nbytes:
            return None
        slots = self.slots.take(1, keep=self._save_reserve)
        return None if slots is None else self.slots.payload(slots[0])

    def begin_loads(self) -> None:
        """A new step's loads follow: the previous step is done (the runner read its outputs), its sources may go."""
        self._held = []

    def load(self, blocks: list[tuple[int, bytes | memoryview]]) -> None:
        """blocks: (engine block id, payload); copied in stream order before the step's forward pass. A step may
        load in several parts (each part's DMA runs while the next part is read), after one `begin_loads`."""
        if not blocks:
            return
        k = len(blocks)
        staging = torch.empty((k, self.block_nbytes), dtype=torch.uint8, device=self.device)
        pageable = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")  # only read from
            for i, (_, data) in enumerate(blocks):
                if self._stage and not self._in_slot(data):
                    pageable.append(i)
                    continue
                # From a pinned slot this is an asynchronous DMA: the payload must outlive it, hence held (which
                # also keeps its slot from being reused) until the next step.
                staging[i].copy_(torch.frombuffer(data, dtype=torch.uint8), non_blocking=self._on_gpu)
                self._held.append(data)
            rows = self._stage[0].shape[0] if self._stage else 1
            for turn, start in enumerate(range(0, len(pageable), rows)):
                buf, done = self._stage[turn % 2], self._stage_done[turn % 2]
                if done is not None:
                    done.synchronize()  # its previous DMA (this load's, or the last step's) has read it
                for j, i in enumerate(pageable[start:start + rows]):
                    buf[j].copy_(torch.frombuffer(blocks[i][1], dtype=torch.uint8))  # a host memcpy
                    staging[i].copy_(buf[j], non_blocking=self._on_gpu)
                if self._on_gpu:
                    self._stage_done[turn % 2] = torch.cuda.Event()
                    self._stage_done[turn % 2].record(torch.cuda.current_stream(self.device))
            self.staged_loads += len(pageable)
        idx = torch.tensor([b[0] for b in blocks], dtype=torch.long).to(self.device, non_blocking=True)
        offset = 0
        for layer in self.layers:
            width = layer[0].numel() * layer.element_size()
            part = staging[:, offset:offset + width].view(layer.dtype).reshape((k, *layer.shape[1:]))
            layer.index_copy_(0, idx, part)  # into the logical view: any order in memory
            offset += width

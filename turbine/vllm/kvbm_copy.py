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
- GPU: a save gathers the step's blocks on the GPU (one small copy kernel per layer, in stream order after
  the forward pass), then a side stream copies them to pinned host memory while the next step runs; a
  writer thread waits for that copy and hands the blocks to the tiers (host tier: the pinned memory itself;
  disk and shared tiers: files written there), so neither the D2H copy nor any file I/O is on the model
  runner's path. A load copies each block host → GPU (from pinned memory: DMA) and scatters it into every
  layer, in stream order before the forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("turbine.vllm.kvbm")

# Saves waiting for their D2H copy and the writer beyond this many bytes are dropped (the blocks are then
# simply not in the tiers: recomputed when needed), so a slow disk cannot grow pinned memory without bound.
MAX_PENDING_SAVE_BYTES = 4 << 30


@dataclass
class _PendingSave:
    host: torch.Tensor                      # (k, block bytes) uint8: pinned on a GPU
    done: torch.cuda.Event | None           # the D2H copy's completion (None: already copied)
    blocks: list[tuple[int, int | None]]    # (hash, parent hash) of each row


class KvCacheBlocks:
    """The engine's KV caches seen as whole blocks: `save` after a forward pass, `load` before one."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], *, num_blocks: int, num_kv_heads: int,
                 block_size: int, head_size: int, store_blocks: Callable[[torch.Tensor, list], None],
                 background: bool | None = None):
        """`store_blocks(rows, [(hash, parent), ...])` puts host rows (uint8, one block each) into the tiers;
        `background` (default: on a GPU) runs it on the writer thread instead of in `save`."""
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
        self.background = self._on_gpu if background is None else background
        if self.background:
            self._queue: queue.Queue[_PendingSave | threading.Event | None] = queue.Queue()
            self._pending_bytes = 0
            self.dropped_saves = 0
            self._lock = threading.Lock()
            self._writer = threading.Thread(target=self._write_loop, name="kvbm-writer", daemon=True)
            self._writer.start()

    # ---- saves (after the forward pass)
    def save(self, blocks: list[tuple[int, int, int | None]]) -> None:
        """blocks: (engine block id, hash, parent hash). In the background, returns before they are stored."""
        if not blocks:
            return
        if self.background and not self._reserve(len(blocks) * self.block_nbytes):
            return
        rows = self._gather([b[0] for b in blocks])
        meta = [(h, parent) for _, h, parent in blocks]
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                done.record(self._stream)
            rows.record_stream(self._stream)  # the gather buffer is the side stream's until its copy is done
            rows = host
        if self.background:
            self._queue.put(_PendingSave(rows, done, meta))
        else:
            if done is not None:
                done.synchronize()
            self._store_blocks(rows, meta)

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

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._pending_bytes + nbytes > MAX_PENDING_SAVE_BYTES:
                self.dropped_saves += 1
                if self.dropped_saves == 1 or self.dropped_saves % 1000 == 0:
                    log.warning("kvbm: %d saves dropped: the tiers' writer is %d bytes behind", self.dropped_saves,
                                self._pending_bytes)
                return False
            self._pending_bytes += nbytes
            return True

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # flush(): everything before it is stored
                item.set()
                continue
            try:
                if item.done is not None:
                    item.done.synchronize()
                self._store_blocks(item.host, item.blocks)
            except Exception:  # a tier that fails must not stop later saves
                log.exception("kvbm: saving %d blocks failed", len(item.blocks))
            finally:
                with self._lock:
                    self._pending_bytes -= item.host.numel()

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
    def load(self, blocks: list[tuple[int, bytes | memoryview]]) -> None:
        """blocks: (engine block id, payload); copied in stream order before the step's forward pass."""
        self._held = []  # the previous step is done (the runner read its outputs): its sources may go
        if not blocks:
            return
        k = len(blocks)
        staging = torch.empty((k, self.block_nbytes), dtype=torch.uint8, device=self.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")  # only read from
            for i, (_, data) in enumerate(blocks):
                # From pinned host memory (the host tier on a GPU) this is an asynchronous DMA: the payload
                # must outlive it, hence held until the next step.
                staging[i].copy_(torch.frombuffer(data, dtype=torch.uint8), non_blocking=self._on_gpu)
                self._held.append(data)
        idx = torch.tensor([b[0] for b in blocks], dtype=torch.long).to(self.device, non_blocking=True)
        offset = 0
        for layer in self.layers:
            width = layer[0].numel() * layer.element_size()
            part = staging[:, offset:offset + width].view(layer.dtype).reshape((k, *layer.shape[1:]))
            layer.index_copy_(0, idx, part)  # into the logical view: any order in memory
            offset += width

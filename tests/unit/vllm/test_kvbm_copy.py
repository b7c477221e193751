"""turbine/vllm/kvbm_copy.py: one block payload format whatever order the engine's cache has in memory (the
CPU backend's contiguous (B, H, N, 2D), the GPU's NHD (B, N, H, 2D) seen through its logical view), and the
host slots and writer thread that a GPU's saves go through (run here on CPU tensors: everything but the CUDA
streams and the pinning)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from turbine.vllm import kvbm_copy
from turbine.vllm.kvbm_copy import KvCacheBlocks

BLOCKS, HEADS, N, HEAD = 8, 3, 4, 2  # per layer: (8, 3, 4, 2*2)
LAYERS = 3


def _caches(nhd: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        if nhd:  # memory (B, N, H, 2D), as vLLM's FlashAttention stores it; the logical view (B, H, N, 2D)
            raw = torch.randn((BLOCKS, N, HEADS, 2 * HEAD), generator=g)
            out[f"layer.{i}"] = raw.permute(0, 2, 1, 3)
        else:
            out[f"layer.{i}"] = torch.randn((BLOCKS, HEADS, N, 2 * HEAD), generator=g)
    return out


def _blocks(caches, stored, **kw) -> KvCacheBlocks:
    return KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                         store_blocks=lambda blocks: stored.extend((h, p, bytes(d)) for h, p, d in blocks), **kw)


def _canonical(caches, block_id: int) -> bytes:
    return b"".join(t[block_id].contiguous().numpy().tobytes() for t in caches.values())


@pytest.mark.parametrize("nhd", [False, True], ids=["contiguous (CPU)", "NHD in memory (GPU default)"])
def test_a_saved_block_is_every_layers_logical_slice(nhd):
    caches = _caches(nhd, seed=1)
    assert nhd != all(t.is_contiguous() for t in caches.values())
    stored = []
    copier = _blocks(caches, stored)
    copier.save([(5, 0xA, None), (2, 0xB, 0xA)])
    assert [(h, p) for h, p, _ in stored] == [(0xA, None), (0xB, 0xA)]
    assert stored[0][2] == _canonical(caches, 5) and stored[1][2] == _canonical(caches, 2)
    assert copier.block_nbytes == len(stored[0][2]) == LAYERS * HEADS * N * 2 * HEAD * 4


def test_a_block_moves_between_layouts_unchanged():
    """What a worker with one layout saved, a worker with the other loads into its own blocks: the same K/V."""
    cpu, gpu_like = _caches(False, seed=2), _caches(True, seed=3)
    saved = []
    _blocks(cpu, saved).save([(1, 0x1, None), (6, 0x2, 0x1)])
    _blocks(gpu_like, []).load([(4, saved[0][2]), (0, memoryview(bytearray(saved[1][2])))])
    for name in cpu:
        assert torch.equal(gpu_like[name][4], cpu[name][1]) and torch.equal(gpu_like[name][0], cpu[name][6])
    back = []
    _blocks(gpu_like, back).save([(4, 0x1, None)])
    assert back[0][2] == saved[0][2]
    # The other blocks of the loading cache are untouched.
    untouched = _caches(True, seed=3)
    for name in cpu:
        assert torch.equal(gpu_like[name][3], untouched[name][3])


def test_a_cache_of_another_logical_shape_is_refused_by_layer():
    caches = {"model.layers.0.attn": torch.zeros((2, BLOCKS, N, HEADS, HEAD))}  # (2, B, N, H, D): K, V apart
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn.*\(2, 8, 4, 3, 2\).*\(8, 3, 4, 4\)"):
        _blocks(caches, [])


def test_background_saves_are_stored_by_the_writer_after_the_cache_changed():
    """The GPU path's hand-over: save returns at once; the payload is in a host slot already, so the engine
    may overwrite the block in the next step and the stored payload is still the one computed."""
    caches = _caches(True, seed=4)
    expected = _canonical(caches, 3)
    release = threading.Event()
    stored = []

    def slow_store(blocks):
        release.wait(10)
        stored.extend((h, p, bytes(d)) for h, p, d in blocks)

    copier = KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                           store_blocks=slow_store, background=True, pending_bytes=4 * LAYERS * HEADS * N * 16)
    copier.save([(3, 0x3, None)])
    assert stored == []  # not yet: the writer holds it
    for t in caches.values():
        t[3].zero_()  # the next step reuses the block
    release.set()
    copier.flush()
    assert stored == [(0x3, None, expected)]
    copier.close()
    assert not copier._writer.is_alive()


def test_a_slot_is_free_again_once_nothing_holds_its_payload_and_saves_beyond_the_slots_are_dropped():
    caches = _caches(False, seed=5)
    kept = []  # what a host tier would hold
    block_bytes = LAYERS * HEADS * N * 2 * HEAD * 4
    copier = KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                           store_blocks=lambda blocks: kept.extend(blocks), background=True,
                           host_tier_bytes=2 * block_bytes, pending_bytes=block_bytes)
    assert copier.slots.free == 3
    copier.save([(0, 0x10, None), (1, 0x11, 0x10)])
    copier.flush()
    assert copier.slots.free == 1 and [h for h, _, _ in kept] == [0x10, 0x11]
    assert bytes(kept[0][2]) == _canonical(caches, 0)
    copier.save([(2, 0x12, 0x11), (3, 0x13, 0x12)])  # two slots wanted, one free: dropped, not queued
    assert copier.dropped_saves == 1
    del kept[0]  # the host tier evicts 0x10: its slot comes back
    gc.collect()
    assert copier.slots.free == 2
    copier.save([(2, 0x12, 0x11), (3, 0x13, 0x12)])
    copier.flush()
    assert [h for h, _, _ in kept] == [0x11, 0x12, 0x13] and copier.slots.free == 0
    assert bytes(kept[1][2]) == _canonical(caches, 2) and bytes(kept[0][2]) == _canonical(caches, 1)
    copier.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_loads_from_pageable_memory_go_through_the_staging_and_slot_payloads_do_not(device):
    """A GPU's load: payloads read from files (pageable bytes) are copied into the two staging buffers in turns,
    each DMA'd while the other fills; a slot's payload (a host-tier hit) is DMA'd as it is and held until the next
    step. On CPU the same path runs unpinned (stage_loads=True); on a GPU host (gpu_tests.sh tests) pinned."""
    source = _caches(True, seed=6)
    saved = []
    _blocks(source, saved).save([(i, 0x20 + i, None) for i in range(5)])
    caches = {k: v.to(device) for k, v in _caches(True, seed=7).items()}
    kept = []
    copier = KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                           store_blocks=lambda blocks: kept.extend(blocks), background=True, stage_loads=True,
                           stage_rows=1)
    copier.save([(7, 0x99, None)])  # a slot payload, as the host tier holds it
    copier.flush()
    slot_payload = kept[0][2]
    expected_7 = {k: v[7].clone() for k, v in caches.items()}
    # Three pageable payloads over two one-row buffers: the first is used again once its DMA is done.
    copier.load([(0, saved[0][2]), (7, slot_payload), (5, bytearray(saved[2][2])), (2, saved[4][2])])
    assert copier.staged_loads == 3 and len(copier._held) == 1  # the slot payload alone is held
    copier.begin_loads()
    copier.load([(1, saved[1][2]), (6, saved[3][2])])  # the next step: the same buffers
    assert copier.staged_loads == 5 and copier._held == []
    if device == "cuda":
        torch.cuda.synchronize()
    for name in caches:
        got = caches[name].cpu()
        assert torch.equal(got[0], source[name][0]) and torch.equal(got[5], source[name][2])
        assert torch.equal(got[2], source[name][4])
        assert torch.equal(got[1], source[name][1]) and torch.equal(got[6], source[name][3])
        assert torch.equal(got[7], expected_7[name].cpu())
    copier.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_file_reads_go_straight_into_host_slots_and_the_host_tier_keeps_them(tmp_path, device):
    """A GPU's disk hit: the disk tier reads the payload into a free host slot (read_buffer), the load DMAs it
    from there without the staging, and its promotion into the host tier keeps that slot (no copy); once only
    the saves' reserve is free, a read goes to bytes of its own and its load through the staging."""
    from turbine.kvbm import Block, DiskStore, HostStore, TieredStore

    source = _caches(True, seed=8)
    saved = []
    _blocks(source, saved).save([(i, 0x30 + i, None) for i in range(4)])
    block_bytes = len(saved[0][2])
    caches = {k: v.to(device) for k, v in _caches(True, seed=9).items()}
    copier = KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                           store_blocks=lambda blocks: None, background=True, stage_loads=True, stage_rows=2,
                           host_tier_bytes=2 * block_bytes, pending_bytes=2 * block_bytes)
    assert copier.slots.free == 4 and copier._save_reserve == 1  # three slots for reads
    disk = DiskStore(str(tmp_path / "disk"), 1 << 20)
    for h, _, payload in saved:
        disk.put(Block(h, None, N, payload))
    disk.read_buffer = copier.read_buffer
    store = TieredStore([HostStore(2 * block_bytes), disk])
    got = [store.get(0x30 + i) for i in range(4)]
    assert [tier for _, tier in got] == ["disk"] * 4
    in_slot = [copier.slots.holds(b.data) for b, _ in got]
    assert in_slot == [True, True, True, False]  # the fourth found only the reserve free
    copier.begin_loads()
    copier.load([(i, b.data) for i, (b, _) in enumerate(got)])
    assert copier.staged_loads == 1
    if device == "cuda":
        torch.cuda.synchronize()
    for name in caches:
        got_cache = caches[name].cpu()
        for i in range(4):
            assert torch.equal(got_cache[i], source[name][i])
    # The host tier (two blocks) kept the last two promoted: 0x32's slot stays its own; 0x30's and 0x31's are
    # free again once nothing reads them (the next step's loads begin).
    host = store.tiers[0]
    assert host.contains(0x32) and host.contains(0x33) and not host.contains(0x30) and not host.contains(0x31)
    del got
    copier.begin_loads()
    gc.collect()
    assert copier.slots.free == 3 and copier.slots.holds(host.get(0x32).data)
    copier.close()


def test_shared_slots_reach_the_disk_through_the_writer_process(tmp_path, monkeypatch):
    """A GPU worker's disk tier: the slots are a memfd the writer process maps, and the step's blocks go to their
    files from there (nothing written in this process), then the slots are free again."""
    from turbine.kvbm import Block, DiskStore, TieredStore
    from turbine.kvbm import files as kvbm_files
    from turbine.kvbm.file_writer import ProcessFileWriter

    caches = _caches(True, seed=5)
    expected = [_canonical(caches, i) for i in range(3)]
    disk = DiskStore(str(tmp_path / "disk"), 1 << 20)
    store = TieredStore([disk])
    copier = KvCacheBlocks(caches, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=N, head_size=HEAD,
                           store_blocks=lambda blocks: store.put_many([Block(h, p, N, d) for h, p, d in blocks]),
                           background=True, shared_slots=True, pending_bytes=4 * len(expected[0]))
    assert copier.slots.fd is not None and copier.slots.free == 4
    writer = ProcessFileWriter(copier.slots.fd, copier.slots.nbytes, copier.slots.offset_of)
    disk.write_files = writer.write

    def not_here(*a, **kw):
        raise AssertionError("a file was written in the engine's process")
    monkeypatch.setattr(kvbm_files, "write_block_file", not_here)
    try:
        copier.save([(i, 0x40 + i, None) for i in range(3)])
        for t in caches.values():
            t.zero_()  # the next step reuses the blocks
        copier.flush()
        monkeypatch.undo()
        assert [bytes(store.get(0x40 + i)[0].data) for i in range(3)] == expected
        gc.collect()
        assert copier.slots.free == 4
    finally:
        copier.close()
        writer.close()

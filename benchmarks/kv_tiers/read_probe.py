"""How fast the disk tier's reads can go on this host, and how much of it the tier's Python path keeps: one
returning prompt's worth of block files (--blocks of --block-mib, written once through a DiskStore, so in the page
cache as the tier's own files are), then read back by N threads at a time, three ways:
  raw     os.preadv of each file straight into a host slot (no header, no checksum): the host's ceiling;
  tier    DiskStore.get into host slots, as the vLLM connector's readers do (open, header, readinto, xxh3 check);
  procs   the same `tier` reads split over N processes (one thread each): what the GIL costs the threads;
then, where there is a GPU, one DMA of every slot to the device (the load's other half). Slots are pinned on a
GPU. Prints GB/s per way and thread count (median of --repeats) and writes them to --out.

  python -m benchmarks.kv_tiers.read_probe --dir /tmp/read-probe --blocks 1024 --threads 1,4,8,16
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.lib.args import parse_int_list
from benchmarks.lib.results import dump_json, git_commit
from turbine.kvbm.block import HEADER_SIZE, Block, file_name
from turbine.kvbm.files import DiskStore


def _slots(nbytes: int, count: int, pinned: bool):
    import torch
    return torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=pinned)  # rows as numpy views below


def _read_raw(directory: str, hashes: list[int], rows, threads: int) -> None:
    def one(i: int) -> None:
        fd = os.open(os.path.join(directory, file_name(hashes[i])), os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(rows[i])], HEADER_SIZE)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(hashes))))


def _read_tier(store: DiskStore, hashes: list[int], rows, threads: int) -> None:
    slot = iter(range(len(hashes)))
    store.read_buffer = lambda n: memoryview(rows[next(slot)])  # next() is atomic under the GIL
    with ThreadPoolExecutor(threads) as pool:
        assert all(b is not None for b in pool.map(store.get, hashes))


def _proc_reads(directory: str, cap: int, hashes: list[int], nbytes: int) -> None:
    store = DiskStore(directory, cap)
    buf = bytearray(nbytes)
    store.read_buffer = lambda n: memoryview(buf)
    for h in hashes:
        assert store.get(h) is not None


def _read_procs(directory: str, cap: int, hashes: list[int], nbytes: int, procs: int) -> None:
    ctx = multiprocessing.get_context("fork")
    ps = [ctx.Process(target=_proc_reads, args=(directory, cap, hashes[i::procs], nbytes)) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
        assert p.exitcode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a scratch folder (emptied first) on the disk the tier would use")
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--threads", type=parse_int_list, default=[1, 4, 8, 16])
    p.add_argument("--ways", default="raw,tier,procs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    gpu = torch.cuda.is_available()
    nbytes = int(a.block_mib * 2**20)
    shutil.rmtree(a.dir, ignore_errors=True)
    cap = 2 * a.blocks * (nbytes + HEADER_SIZE)
    store = DiskStore(a.dir, cap)
    rng = random.Random(1)
    hashes = [rng.getrandbits(63) for _ in range(a.blocks)]
    payload = bytes(rng.getrandbits(8) for _ in range(4096)) * (nbytes // 4096)
    for h in hashes:
        store.put(Block(h, None, 16, payload))
    slots = _slots(nbytes, a.blocks, pinned=gpu)
    slots.zero_()  # touched once: the timed reads meet no first-touch page faults
    rows = slots.numpy()  # each row a writable buffer over the (pinned) slot
    gb = a.blocks * nbytes / 1e9
    ways = {"raw": lambda t: _read_raw(store.directory, hashes, rows, t),
            "tier": lambda t: _read_tier(store, hashes, rows, t),
            "procs": lambda t: _read_procs(store.directory, cap, hashes, nbytes, t)}
    results: dict[str, dict[int, float]] = {}
    for way in a.ways.split(","):
        for t in a.threads:
            runs = []
            for _ in range(a.repeats):
                began = time.perf_counter()
                ways[way](t)
                runs.append(gb / (time.perf_counter() - began))
            results.setdefault(way, {})[t] = statistics.median(runs)
            print(f"[read_probe] {way:5} threads={t:2}: {results[way][t]:6.2f} GB/s "
                  f"({', '.join(f'{r:.2f}' for r in runs)})", flush=True)
    if gpu:  # one DMA per slot, as KvCacheBlocks.load issues them
        dev = torch.empty_like(slots, device="cuda")
        runs = []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            for i in range(a.blocks):
                dev[i].copy_(slots[i], non_blocking=True)
            torch.cuda.synchronize()
            runs.append(gb / (time.perf_counter() - began))
        results["h2d"] = {1: statistics.median(runs)}
        print(f"[read_probe] h2d   one stream: {results['h2d'][1]:6.2f} GB/s", flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(dump_json({"benchmark": "read_probe", "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                               "host": os.uname().nodename, "gpu": torch.cuda.get_device_name() if gpu else None,
                               "argv": sys.argv[1:] if argv is None else argv, "gb": gb, "gb_per_s": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

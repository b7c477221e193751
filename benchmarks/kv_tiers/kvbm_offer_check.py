"""What the kvbm connector's check of a file block before it is offered costs (turbine.kvbm.FileCheck, run by the
scheduler half in get_num_new_matched_tokens), beside the load that follows it (the worker half's DiskStore.get).

The check reads the whole file and verifies its checksum, so a block loaded from a file tier is read twice:
once by the scheduler half (in vLLM's scheduler loop, several blocks at a time in FILE_READERS threads) and
once by the worker half (its read threads). A file verified once is remembered while unchanged (fstat only).
Measured on real files in a DiskStore directory, block sizes of the models the tiers were measured with:

  smollm2-cpu   SmolLM2-135M float32, 128-token blocks (the CPU build's default): 5.9 MB
  llama8b-gpu   Llama-3.1-8B bf16, 16-token blocks (docs/benchmarks/gpu.md's KV-tier runs): 2 MiB

Each size: --blocks files written, then per block, medians in ms: `check` a first check (open, read,
checksum), `remembered` a later one, `load_after_check` the worker half's read of the file just checked
(read, checksum, copy out), `load_alone` that read with no check before it (what a load cost before the
check), and `check_parallel` the wall time per block of checking all of them at once in FILE_READERS
threads (what one lookup does). Page cache warm (the files were just written, as in the kv_tiers runs)
and, with --cold, dropped before each read (posix_fadvise DONTNEED on the file: no root needed).

    .venv/bin/python -m benchmarks.kv_tiers.kvbm_offer_check --out benchmarks/results/kv_tiers/kvbm_offer_check-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from turbine.kvbm import Block, DiskStore, FileCheck
from turbine.kvbm.block import file_name
from turbine.vllm.kvbm_connector import FILE_READERS

SIZES = {"smollm2-cpu": 30 * 3 * 128 * 128 * 4, "llama8b-gpu": 32 * 8 * 16 * 256 * 2}


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, items) -> list[float]:
    out = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        out.append((time.perf_counter() - start) * 1000)
    return out


def measure(nbytes: int, blocks: int, cold: bool, directory: str) -> dict:
    store = DiskStore(directory, capacity_bytes=(blocks + 1) * (nbytes + 64))
    payload = os.urandom(nbytes)
    hashes = list(range(1, blocks + 1))
    for h in hashes:
        store.put(Block(h, None, 16, payload))
    paths = {h: os.path.join(store.directory, file_name(h)) for h in hashes}
    os.sync()
    result = {"payload_bytes": nbytes, "blocks": blocks}
    for cache in ("warm", "cold") if cold else ("warm",):
        check = FileCheck()
        before = (lambda h: drop_cache(paths[h])) if cache == "cold" else (lambda h: None)

        def first(h, check=check, before=before):
            before(h)
            assert check.check(paths[h], h) == FileCheck.OK

        def load(h, before=before):
            before(h)
            assert store.get(h) is not None

        # The load right after the check is what the connector does (the check warms the page cache for it);
        # alone, the load is what a load cost before there was a check.
        ms = {"check": timed(first, hashes),
              "remembered": timed(lambda h: check.check(paths[h], h), hashes),
              "load_after_check": timed(lambda h: store.get(h), hashes),
              "load_alone": timed(load, hashes)}
        result[cache] = {k: round(statistics.median(v), 3) for k, v in ms.items()}
        result[cache]["check_gb_s"] = round(nbytes / result[cache]["check"] / 1e6, 2)
        # All blocks' first checks at once through the connector's thread count (one lookup's checks):
        # wall time per block.
        fresh = FileCheck()
        for h in hashes:
            before(h)
        with ThreadPoolExecutor(FILE_READERS) as pool:
            start = time.perf_counter()
            assert all(r == FileCheck.OK for r in pool.map(fresh.check, paths.values(), hashes))
            result[cache]["check_parallel"] = round((time.perf_counter() - start) * 1000 / blocks, 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--cold", action="store_true", help="also with each file dropped from the page cache first")
    p.add_argument("--dir", default=None, help="where the files go (default: a temp folder; the filesystem matters)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = {"host": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "blocks": args.blocks, "results": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for name in args.sizes.split(","):
            out["results"][name] = r = measure(SIZES[name], args.blocks, args.cold, os.path.join(d, name))
            for cache in ("warm", "cold"):
                if cache in r:
                    print(f"{name} ({SIZES[name]} B, {cache}): " + ", ".join(f"{k} {v}" for k, v in r[cache].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

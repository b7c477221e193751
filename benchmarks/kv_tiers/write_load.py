"""The disk tier's writes, made by another process: N threads put blocks of --block-mib into a DiskStore at
--gbps in all (checksummed, written under a temp name, renamed; the store evicts to stay within --cap-gb), until
--seconds pass or SIGTERM. Run beside a worker without tiers, it tells what the writes cost that worker through the
host (cores, memory bandwidth, the kernel's page cache) rather than through its own process (the GIL).

  python -m benchmarks.kv_tiers.write_load --dir /dev/shm/write-load --threads 4 --gbps 3.6 --seconds 300
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import threading
import time

from turbine.kvbm.block import Block
from turbine.kvbm.files import DiskStore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--gbps", type=float, default=3.6, help="GB/s written by all threads together")
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--cap-gb", type=float, default=4.0)
    p.add_argument("--seconds", type=float, default=300.0)
    a = p.parse_args(argv)
    store = DiskStore(a.dir, int(a.cap_gb * 2**30))
    nbytes = int(a.block_mib * 2**20)
    per_thread_s = nbytes / (a.gbps * 1e9 / a.threads)  # one block's time per thread at the asked rate
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    written = [0] * a.threads

    def writer(i: int) -> None:
        rng = random.Random(i)
        pool = bytearray(os.urandom(64)) * (256 * 2**20 // 64)  # 256 MiB to cycle through: not cache-hot
        slices = len(pool) // nbytes
        t_next = time.monotonic()
        while not stop.is_set():
            k = rng.randrange(slices)
            store.put(Block(rng.getrandbits(63), None, 16, memoryview(pool)[k * nbytes:(k + 1) * nbytes]))
            written[i] += nbytes
            t_next += per_thread_s
            if (delay := t_next - time.monotonic()) > 0:
                stop.wait(delay)

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(a.threads)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    stop.wait(a.seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    print(f"write_load: {sum(written) / 1e9:.1f} GB in {wall:.0f} s = {sum(written) / 1e9 / wall:.2f} GB/s "
          f"({a.threads} threads, {a.gbps} asked)", flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

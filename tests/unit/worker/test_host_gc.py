"""The worker host freezes the start-up heap once its engines have started (as `vllm serve` freezes its own):
what start-up built lives as long as the process, and the collector's full passes over it stalled every stream
at once (on an H200, Turbine's ITL p99 8.4-11 ms against `vllm serve`'s 7.5-8 ms before; docs/benchmarks/gpu.md)."""

from __future__ import annotations

import asyncio
import gc

from turbine.mocker.args import parse_mocker_args
from turbine.mocker.worker import SimulatedEngines
from turbine.worker.host import WorkerHost


async def test_the_host_freezes_the_start_up_heap_before_it_registers(tmp_path, model_dir):
    # --gc-interval 0: the mocker's own pacing (which also freezes) stays off; only the host's freeze is left.
    cfg = parse_mocker_args(["--model", str(model_dir), "--gc-interval", "0", "--discovery-backend", "file",
                             "--discovery-dir", str(tmp_path), "--host", "127.0.0.1"])
    host = WorkerHost(cfg, SimulatedEngines(cfg))
    gc.unfreeze()
    run = asyncio.create_task(host.run())
    try:
        async with asyncio.timeout(30):
            while not any(p.is_file() for p in (tmp_path / "leases").rglob("*")) and not run.done():
                await asyncio.sleep(0.05)
        assert not run.done(), run.result()
        assert gc.get_freeze_count() > 0
    finally:
        host.stopping.set()
        await asyncio.wait_for(run, 30)
        gc.unfreeze()

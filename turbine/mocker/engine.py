"""One simulated worker's engine: its scheduler stepping in (scaled) real time.

Each step's duration comes from the timing profile, divided by the speedup ratio; with a
ratio of 0 steps take no time at all (the loop only yields to the event loop between
steps, so many simulated workers share one process fairly). Each step ends at a deadline
counted from the previous step's deadline, so the time spent planning steps and serving
requests does not add up into slower simulated steps; a loop that fell more than
MAX_CATCH_UP_S behind (a stalled process) starts counting afresh instead of bursting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from turbine.mocker.scheduler import Scheduler, SeqOutput, Sequence
from turbine.mocker.timing import TimingProfile

MAX_CATCH_UP_S = 1.0


class MockEngine:
    def __init__(self, scheduler: Scheduler, timing: TimingProfile, speedup_ratio: float,
                 on_step: Callable[[Scheduler], None] | None = None):
        self.scheduler = scheduler
        self.timing = timing
        self.speedup_ratio = speedup_ratio
        # Called after each step and each abort, like vLLM's stat loggers (load metrics).
        self.on_step = on_step
        self._outputs: dict[Sequence, asyncio.Queue[SeqOutput]] = {}
        self._wake = asyncio.Event()

    def submit(self, seqs: list[Sequence]) -> asyncio.Queue[SeqOutput]:
        """Queue the sequences of one request; their outputs arrive on the returned queue."""
        queue: asyncio.Queue[SeqOutput] = asyncio.Queue()
        for seq in seqs:
            self._outputs[seq] = queue
            self.scheduler.add(seq)
        self._wake.set()
        return queue

    def abort(self, seqs: list[Sequence]) -> None:
        """Cancel sequences now: their blocks are freed before this returns."""
        for seq in seqs:
            if self._outputs.pop(seq, None) is not None:
                self.scheduler.abort(seq)
        if self.on_step is not None:
            self.on_step(self.scheduler)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler, outputs = self.scheduler, self._outputs
        next_start = loop.time()
        while True:
            if not scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                next_start = loop.time()
            step = scheduler.schedule()
            if self.speedup_ratio > 0:
                ms = self.timing.step_ms(step.prefill_tokens, step.prefill_pairs, step.decode_seqs,
                                         step.decode_kv_tokens)
                next_start = max(next_start + ms / 1000 / self.speedup_ratio, loop.time() - MAX_CATCH_UP_S)
                await asyncio.sleep(next_start - loop.time())
            else:
                await asyncio.sleep(0)
            for out in scheduler.complete(step):
                queue = outputs[out.seq]
                if out.finish_reason is not None:
                    del outputs[out.seq]
                queue.put_nowait(out)
            if self.on_step is not None:
                self.on_step(scheduler)

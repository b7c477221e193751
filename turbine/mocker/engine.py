"""One simulated worker's engine: its scheduler stepping in (scaled) real time.

Each step's duration comes from the timing profile, divided by the speedup ratio; with a
ratio of 0 steps take no time at all (the loop only yields to the event loop between
steps, so many simulated workers share one process fairly). Each step ends at a deadline
counted from the previous step's deadline, so the time spent planning steps and serving
requests does not add up into slower simulated steps; a loop that fell more than
MAX_CATCH_UP_S behind (a stalled process) starts counting afresh instead of bursting.

A decode worker's KV pulls (disaggregated serving) run beside the steps, as the real
transfers do: each lands once its transfer time (kv_transfer.py), scaled by the same ratio,
has passed, checked at every step boundary. A step with nothing to compute waits for the
next landing or a new request instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from turbine.mocker.kv_transfer import KvTransferModel
from turbine.mocker.scheduler import Scheduler, SeqOutput, Sequence
from turbine.mocker.timing import TimingProfile

MAX_CATCH_UP_S = 1.0


class Outputs:
    """One request's step outputs on their way from the engine to its handler: a list the
    engine appends to and at most one waiting reader. (asyncio.Queue does the same with more
    bookkeeping, and this runs for every token of every request.)"""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list[SeqOutput] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, out: SeqOutput) -> None:
        self._items.append(out)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[SeqOutput]:
        """Every output not taken yet, oldest first; waits for one when there is none."""
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


class MockEngine:
    def __init__(self, scheduler: Scheduler, timing: TimingProfile, speedup_ratio: float,
                 on_step: Callable[[Scheduler], None] | None = None,
                 kv_transfer: KvTransferModel | None = None, lora_load_ms: float = 0.0):
        self.scheduler = scheduler
        self.lora_load_ms = lora_load_ms  # each adapter a step brings into an active slot adds this
        self.timing = timing
        self.speedup_ratio = speedup_ratio
        self.kv_transfer = kv_transfer  # None: pulls take no time
        # Called after each step and each abort, like vLLM's stat loggers (load metrics).
        self.on_step = on_step
        self._outputs: dict[Sequence, Outputs] = {}
        self._wake = asyncio.Event()
        self._pulls: dict[Sequence, float] = {}  # pulling sequence -> when its KV lands (loop time)

    def submit(self, seqs: list[Sequence]) -> Outputs:
        """Queue the sequences of one request; their outputs arrive on the returned Outputs."""
        outputs = Outputs()
        for seq in seqs:
            self._outputs[seq] = outputs
            self.scheduler.add(seq)
        self._wake.set()
        return outputs

    def abort(self, seqs: list[Sequence]) -> None:
        """Cancel sequences now: their blocks are freed before this returns."""
        for seq in seqs:
            if self._outputs.pop(seq, None) is not None:
                self._pulls.pop(seq, None)
                self.scheduler.abort(seq)
        self._wake.set()  # the freed blocks may admit a waiting request
        if self.on_step is not None:
            self.on_step(self.scheduler)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler, outputs = self.scheduler, self._outputs
        next_start = loop.time()
        while True:
            self._land_pulls(loop.time())
            if not scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                next_start = loop.time()
                continue
            step = scheduler.schedule()
            for seq in step.pulls:
                self._pulls[seq] = loop.time() + self._transfer_s(seq.num_pull_tokens)
            if not step.scheduled:  # only KV pulls in flight (and requests waiting for their blocks)
                if self.on_step is not None and step.pulls:
                    self.on_step(scheduler)  # their blocks are in use now
                await self._wait_for_landing_or_wake(loop)
                next_start = loop.time()
                continue
            if self.speedup_ratio > 0:
                ms = self.timing.step_ms(step.prefill_tokens, step.prefill_pairs, step.decode_seqs,
                                         step.decode_kv_tokens) + step.lora_swaps * self.lora_load_ms
                ms += step.onboard_s * 1000  # blocks loaded from the KV tiers (kv_tiers.py)
                next_start = max(next_start + ms / 1000 / self.speedup_ratio, loop.time() - MAX_CATCH_UP_S)
                await asyncio.sleep(next_start - loop.time())
            else:
                await asyncio.sleep(0)
            for out in scheduler.complete(step):
                if out.finish_reason is None:
                    outputs[out.seq].put(out)
                else:
                    outputs.pop(out.seq).put(out)
            if self.on_step is not None:
                self.on_step(scheduler)

    def _transfer_s(self, num_tokens: int) -> float:
        if self.kv_transfer is None or self.speedup_ratio == 0:
            return 0.0
        return self.kv_transfer.seconds(num_tokens) / self.speedup_ratio

    def _land_pulls(self, now: float) -> None:
        landed = [seq for seq, at in self._pulls.items() if at <= now]
        if landed:
            for seq in landed:
                del self._pulls[seq]
            self.scheduler.land(landed)

    async def _wait_for_landing_or_wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake.clear()
        timeout = max(0.0, min(self._pulls.values()) - loop.time()) if self._pulls else None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

"""`python -m benchmarks.mocker._mocker_lag <turbine mocker flags>`: the unmodified mocker process, with
each simulated step's lateness recorded (benchmark instrumentation only; turbine/ is not changed).

The engine (turbine/mocker/engine.py) ends each step at a deadline counted from the previous
deadline and waits for it with `asyncio.sleep(deadline - now)`.  This wraps that one call, as
seen from the engine module, and records per step: the wall time it woke, how late it woke
(`lag_ms` = wake time - deadline; a step planned after its deadline already passed counts the
full overdue time), and the simulated step duration from the timing profile.  Lag that stays
small means the process keeps up with real time; lag that grows means it falls behind.
It also records each garbage-collector pass (wall time, milliseconds, generation), since a
pass stalls every simulated worker at once. At exit (SIGTERM) the records go to
$MOCKER_LAG_FILE as JSON.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import os
import sys
import time

import turbine.mocker.engine as _engine
from turbine.mocker.timing import TimingProfile

_wake: list[float] = []
_lag_ms: list[float] = []
_step_ms: list[float] = []
_last_step_ms = [0.0]

_orig_step_ms = TimingProfile.step_ms


def _step_ms_recorded(self, *args) -> float:
    ms = _orig_step_ms(self, *args)
    _last_step_ms[0] = ms
    return ms


class _AsyncioSeenByEngine:
    """The engine module's `asyncio`: the real module, except that sleep() records lateness."""

    def __getattr__(self, name):
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(delay, result=None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        step = _last_step_ms[0]
        await asyncio.sleep(delay, result)
        if delay or step:  # speedup 0 sleeps 0 and has no deadline
            _wake.append(time.time())
            _lag_ms.append((loop.time() - deadline) * 1000.0)
            _step_ms.append(step)
        return result


_gc: list[tuple[float, float, int]] = []  # (wall time it began, ms, generation)
_gc_began = [0.0]


def _gc_pass(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_began[0] = time.perf_counter()
    else:
        _gc.append((time.time(), (time.perf_counter() - _gc_began[0]) * 1000.0, info["generation"]))


def _dump() -> None:
    path = os.environ.get("MOCKER_LAG_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"wake": _wake, "lag_ms": _lag_ms, "step_ms": _step_ms, "gc": _gc}, f)


TimingProfile.step_ms = _step_ms_recorded
_engine.asyncio = _AsyncioSeenByEngine()
gc.callbacks.append(_gc_pass)
atexit.register(_dump)

if __name__ == "__main__":
    from turbine.mocker.worker import main

    code = main(sys.argv[1:])
    _dump()
    sys.exit(code)

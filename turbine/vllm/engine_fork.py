"""vLLM's engine-core processes forked from the worker on CPU, not spawned (`--engine-core-start`).

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` for every process it starts, so each engine core
imports torch and vLLM again although the worker that starts it holds both: on a 2-core host that import is about
14 s of CPU, a third of an engine's start (benchmarks/lifecycle/engine_layout.py, `uni-omp` against
`uni-omp-spawn`: ready in 0.68x the time and CPU, decode as fast). On a GPU host vLLM forks the engine core itself
(until CUDA is initialized) and decides alone.

- `auto` (the default) forks where the engine core is also the model runner: vLLM's one-process executor
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one rank). In vLLM CPU's default layout (`mp`: the engine core spawns a
  model-runner process) it keeps vLLM's spawn: there a forked engine core started in 0.78x the time but decoded
  about 10 % slower on one 2-core host (medians of five), though as fast on another (0.71x the time, decode 1.04x
  alone and 1.01x at four at once, medians of three; docs/operations/tests.md).
- `fork` forks in every layout, data-parallel ranks included (the tests' engines: tests/integration/procs.py). The
  model runners an engine core starts are spawned still.
- `spawn` is vLLM CPU's own way everywhere.

Only the engine-core launcher (`vllm.v1.engine.utils`) and the data-parallel coordinator's
(`vllm.v1.engine.coordinator`) are given the fork context, and only while the worker builds the engine. A forked
child holds copies of the worker's open descriptors (the status server's listening socket, say). So that a killed
worker never leaves an engine behind that holds its port and its memory, every process forked while the engine is
built is killed when the worker dies (`PR_SET_PDEATHSIG`, Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

ENGINE_CORE_STARTS = ("auto", "fork", "spawn")
_PR_SET_PDEATHSIG = 1
_forking_for: int | None = None  # the worker's pid while it forks its engine cores (read in the child)
_restore = None  # in the child: puts vLLM's own launcher context back


def model_in_engine_core(engine_args) -> bool:
    """Does vLLM CPU run this engine's model in the engine-core process (its one-process executor)? It does when
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one rank is asked for (vllm/platforms/cpu.py turns `uni` into `mp`
    otherwise)."""
    ranks = ((engine_args.tensor_parallel_size or 1) * (engine_args.pipeline_parallel_size or 1)
             * (engine_args.data_parallel_size or 1))
    return (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and ranks == 1
            and engine_args.distributed_executor_backend in (None, "uni"))


@contextlib.contextmanager
def engine_cores_forked(engine_args, start: str = "auto"):
    """Within it, on CPU, vLLM's engine-core launcher forks where `start` says so (module doc); elsewhere vLLM
    decides as always. RuntimeError naming the flag for a `start` other than auto where vLLM is not on CPU."""
    global _forking_for, _restore
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if start != "auto":
            raise RuntimeError(f"--engine-core-start {start}: on CPU only (on a GPU vLLM forks its engine core "
                               "until CUDA is initialized); drop it")
        yield
        return
    if start == "spawn" or (start == "auto" and not model_in_engine_core(engine_args)):
        yield
        return
    # PR_SET_PDEATHSIG fires when the forking *thread* ends: only the main thread's children are tied to the process.
    if threading.current_thread() is not threading.main_thread():
        log.info("engine core spawned: its launch does not run on the main thread")
        yield
        return
    from vllm.v1.engine import coordinator
    from vllm.v1.engine import utils as launcher

    # The engine cores' launcher, and with data parallelism the DP coordinator's (a process the leader waits for
    # before it starts its engine cores: spawned, it added ~10 s to a data-parallel engine's start on 2 cores).
    launchers = [m for m in (launcher, coordinator) if hasattr(m, "get_mp_context")]
    spawning = [m.get_mp_context for m in launchers]
    fork = multiprocessing.get_context("fork")

    def restore():
        for m, original in zip(launchers, spawning):
            m.get_mp_context = original

    for m in launchers:
        m.get_mp_context = lambda: fork
    _forking_for, _restore = os.getpid(), restore
    try:
        yield
    finally:
        restore()
        _forking_for = _restore = None


def _die_with_parent() -> None:
    """In a process forked while the engine is built: back to vLLM's own launcher, and killed with the worker."""
    global _forking_for, _restore
    parent, restore = _forking_for, _restore
    if parent is None:
        return
    _forking_for = _restore = None
    restore()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the line above: nobody will stop this process
        os._exit(1)


os.register_at_fork(after_in_child=_die_with_parent)

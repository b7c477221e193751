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
- `fork` forks in every layout, data-parallel ranks included (the tests' engines: tests/integration/procs.py), and
  the model runners a forked engine core starts (vLLM CPU's default layout, data parallelism) are forked from it in
  turn, with the OpenMP threads and cores vLLM gives a spawned one (`_RunnerProcess`): each spawned one imported
  torch and vLLM again, ~11 s of CPU on a 2-core host.
- `spawn` is vLLM CPU's own way everywhere.

Only the engine-core launcher (`vllm.v1.engine.utils`) and the data-parallel coordinator's
(`vllm.v1.engine.coordinator`) are given the fork context, and only while the worker builds the engine; under `fork`
also the model-runner launcher (`vllm.v1.executor.multiproc_executor`), which the forked engine cores keep. A forked
child holds copies of the worker's open descriptors (the status server's listening socket, say). So that a killed
worker never leaves an engine behind that holds its port and its memory, every process forked while the engine is
built is killed when the worker dies (`PR_SET_PDEATHSIG`, Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.context
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
    # Under `fork`, the model runners' launcher too: a forked engine core keeps it (`restore` there leaves it).
    runner_launchers = []
    if start == "fork":
        from vllm.v1.executor import multiproc_executor
        runner_launchers = [multiproc_executor] if hasattr(multiproc_executor, "get_mp_context") else []
    originals = {m: m.get_mp_context for m in (*launchers, *runner_launchers)}
    fork = multiprocessing.get_context("fork")
    runner_fork = _RunnerForkContext()

    def restore(modules=launchers):
        for m in modules:
            m.get_mp_context = originals[m]

    for m in launchers:
        m.get_mp_context = lambda: fork
    for m in runner_launchers:
        m.get_mp_context = lambda: runner_fork
    _forking_for, _restore = os.getpid(), restore
    try:
        yield
    finally:
        restore(list(originals))
        _forking_for = _restore = None


def _omp_binding_from_env() -> tuple[int | None, set[int] | None]:
    """The thread count and cores that vLLM CPU's executor puts in the environment for a model runner it starts
    (`vllm.utils.ompmultiprocessing`: OMP_NUM_THREADS with GOMP_CPU_AFFINITY, OMP_PLACES or KMP_AFFINITY)."""
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    cores = None
    if (gomp := os.environ.get("GOMP_CPU_AFFINITY", "").strip()):
        cores = {int(c) for c in gomp.split()}
    elif (places := os.environ.get("OMP_PLACES", "").strip()).startswith("{"):
        cores = {int(c) for c in places.strip("{}").split(",") if c.strip()}
    elif "proclist=[" in (kmp := os.environ.get("KMP_AFFINITY", "")):
        cores = {int(c) for c in kmp.split("proclist=[", 1)[1].split("]", 1)[0].split(",") if c.strip()}
    return (int(threads) if threads.isdigit() else None), cores


class _RunnerProcess(multiprocessing.context.ForkProcess):
    """A model runner forked from its engine core. vLLM binds a runner's OpenMP threads through the environment it
    is started with, which only a spawned process reads (its OpenMP runtime starts then): a forked one inherited
    its engine core's threads and all of its cores, and decoded at 0.7x the speed (13.8 against 21.1 tok/s alone,
    SmolLM2 on 2 cores). So the binding is applied here, before the runner starts."""

    def run(self):
        threads, cores = _omp_binding_from_env()
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if threads:
            import torch
            torch.set_num_threads(threads)
        super().run()


class _RunnerForkContext(multiprocessing.context.ForkContext):
    Process = _RunnerProcess


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

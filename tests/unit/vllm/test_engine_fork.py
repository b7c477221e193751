"""turbine/vllm/engine_fork.py: while the worker builds its engine on CPU with the model in the engine core (vLLM's
one-process executor), vLLM's engine-core launcher forks (vLLM CPU would spawn, importing torch and vLLM again), and
what it forks is killed with the worker; what the engine core launches in turn is spawned as vLLM wants; vLLM CPU's
default layout (a model-runner process) keeps the spawn unless `--engine-core-start fork`, which forks the model
runners from the engine core too, bound to the threads and cores vLLM gives them; `spawn` keeps it everywhere; on a
GPU only `auto` is taken. The real engine's fork and death are checked in
tests/integration/test_migration_vllm.py (a SIGKILLed worker's engine core dies with it)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest
from vllm.v1.engine import utils as launcher
from vllm.v1.executor import multiproc_executor as runner_launcher

from turbine.vllm.args import parse_worker_args
from turbine.vllm.engine_fork import engine_cores_forked, model_in_engine_core

PR_GET_PDEATHSIG = 2


def _child_report(conn) -> None:
    """In a forked child: its parent-death signal and the start methods vLLM's launchers give it now (engine cores,
    model runners)."""
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    conn.send((sig.value, launcher.get_mp_context().get_start_method(),
               runner_launcher.get_mp_context().get_start_method()))
    conn.close()


def _fork_and_report(context) -> tuple[int, str, str]:
    parent_end, child_end = multiprocessing.Pipe()
    proc = context.Process(target=_child_report, args=(child_end,))
    proc.start()
    got = parent_end.recv()
    proc.join(10)
    return got


def engine_args(tp=1, dp=1, backend=None):
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=dp,
                           distributed_executor_backend=backend)


@pytest.fixture
def cpu_spawns(monkeypatch):
    """What vLLM's CPU platform sets for every process vLLM starts, and its one-process executor asked for."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_the_launcher_forks_only_inside(cpu_spawns):
    assert launcher.get_mp_context().get_start_method() == "spawn"
    with engine_cores_forked(engine_args()):
        assert launcher.get_mp_context().get_start_method() == "fork"
    assert launcher.get_mp_context().get_start_method() == "spawn"
    with engine_cores_forked(engine_args(), "spawn"):
        assert launcher.get_mp_context().get_start_method() == "spawn"

def test_only_where_the_model_runs_in_the_engine_core(cpu_spawns, monkeypatch):
    assert model_in_engine_core(engine_args()) and model_in_engine_core(engine_args(backend="uni"))
    assert not model_in_engine_core(engine_args(tp=2))
    assert not model_in_engine_core(engine_args(dp=2))
    assert not model_in_engine_core(engine_args(backend="mp"))
    with engine_cores_forked(engine_args(dp=2)):
        assert launcher.get_mp_context().get_start_method() == "spawn"
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")  # vLLM CPU's default layout: a model-runner process
    assert not model_in_engine_core(engine_args())
    with engine_cores_forked(engine_args()):
        assert launcher.get_mp_context().get_start_method() == "spawn"


def test_fork_forks_in_every_layout(cpu_spawns, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")  # vLLM CPU's default layout
    for args in (engine_args(), engine_args(dp=2), engine_args(tp=2)):
        with engine_cores_forked(args, "fork"):
            assert launcher.get_mp_context().get_start_method() == "fork"
        assert launcher.get_mp_context().get_start_method() == "spawn"
        assert runner_launcher.get_mp_context().get_start_method() == "spawn"
    with engine_cores_forked(engine_args(dp=2), "fork"):
        death, its_launcher, its_runner_launcher = _fork_and_report(launcher.get_mp_context())
    # an engine core forked under `fork` starts no engine core of its own, and forks its model runners
    assert (death, its_launcher, its_runner_launcher) == (signal.SIGKILL, "spawn", "fork")
    assert runner_launcher.get_mp_context().get_start_method() == "spawn"  # the worker's own, put back


def _runner_report(conn) -> None:
    import torch
    conn.send((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
    conn.close()


def test_a_forked_model_runner_gets_the_threads_and_cores_vllm_gives_a_spawned_one(cpu_spawns, monkeypatch):
    """vLLM CPU binds a runner through the environment it starts it with (vllm.utils.ompmultiprocessing), which only
    a spawned process reads: without the binding here a forked runner ran on every core with its engine core's
    threads, and decoded at 0.7x the speed."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to tell a binding from none")
    core = max(os.sched_getaffinity(0))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with engine_cores_forked(engine_args(), "fork"):
        runner_context = runner_launcher.get_mp_context()  # what a forked engine core keeps
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what vLLM's executor sets around the runner's start
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(core))
    parent_end, child_end = multiprocessing.Pipe()
    proc = runner_context.Process(target=_runner_report, args=(child_end,))
    proc.start()
    assert parent_end.recv() == ([core], 1)
    proc.join(10)


def test_off_cpu_only_auto_is_taken(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with engine_cores_forked(engine_args()):
        pass
    for start in ("fork", "spawn"):
        with pytest.raises(RuntimeError, match=f"--engine-core-start {start}: on CPU only"):
            with engine_cores_forked(engine_args(), start):
                pass


def test_an_engine_core_forked_inside_dies_with_the_worker_and_spawns_what_it_starts(cpu_spawns):
    with engine_cores_forked(engine_args()):
        death, its_launcher, its_runner_launcher = _fork_and_report(launcher.get_mp_context())
    assert death == signal.SIGKILL
    assert its_launcher == its_runner_launcher == "spawn"  # what it starts is spawned, as vLLM CPU wants


def test_a_process_forked_outside_is_left_alone():
    death, _, _ = _fork_and_report(multiprocessing.get_context("fork"))
    assert death == 0


def test_the_flag(capsys):
    assert parse_worker_args(["--enforce-eager"]).engine_core_start == "auto"
    assert parse_worker_args(["--enforce-eager", "--engine-core-start", "fork"]).engine_core_start == "fork"
    with pytest.raises(SystemExit):
        parse_worker_args(["--enforce-eager", "--engine-core-start", "clone"])
    assert "--engine-core-start" in capsys.readouterr().err

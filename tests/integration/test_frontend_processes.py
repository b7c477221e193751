"""--frontend-processes N: N frontend processes serve one HTTP port (SO_REUSEPORT), each a whole
frontend; they all answer, and one that dies takes the others down (exit 1) instead of leaving a
port that refuses some connections. Real frontend processes in front of the mocker."""

from __future__ import annotations

import signal
import socket

import psutil
import pytest
from openai import OpenAI

from turbine.frontend.args import parse_frontend_args
from tests.integration.procs import (
    base_env,
    instances_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
)

MODEL = "frontend-processes-model"
PROCESSES = 3


def _listening_children(frontend) -> dict[int, bool]:
    """Each child process of the frontend → whether it has a LISTEN socket on the frontend's port."""
    out = {}
    for child in psutil.Process(frontend.popen.pid).children():
        try:
            if "spawn_main" not in " ".join(child.cmdline()):  # multiprocessing's resource tracker
                continue
            conns = child.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        out[child.pid] = any(c.status == psutil.CONN_LISTEN and c.laddr.port == frontend.port for c in conns)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend_processes")
    env = base_env(str(root / "discovery"))
    mocker = start_mocker("fp-mocker", env, root, "--served-model-name", MODEL, "--speedup-ratio", "0")
    frontend = start_frontend("fp-frontend", env, root, "--frontend-processes", str(PROCESSES))
    procs = [mocker, frontend]
    try:
        wait_until(lambda: len(_listening_children(frontend)) == PROCESSES
                   and all(_listening_children(frontend).values()), 120, "the frontend's processes", procs)
        # Every process watches discovery on its own: wait until the model is everywhere. Each
        # /health below is a new connection, which the kernel gives to any of the processes.
        wait_until(lambda: all(instances_of(frontend, MODEL) == 1 for _ in range(4 * PROCESSES)), 120,
                   "the model in every frontend process", procs)
        yield root, env, frontend
    finally:
        stop_all(procs)


def test_every_process_listens_on_the_one_port_and_answers(stack):
    _, _, frontend = stack
    children = _listening_children(frontend)
    assert len(children) == PROCESSES and all(children.values()), children
    # The parent holds the port but does not listen (it serves nothing).
    parent = psutil.Process(frontend.popen.pid).net_connections(kind="tcp")
    assert not any(c.status == psutil.CONN_LISTEN for c in parent)
    for _ in range(2 * PROCESSES):
        with OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0) as client:  # a new connection
            out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=5)
        assert out.usage.completion_tokens == 5


def test_a_dead_process_stops_the_frontend(stack):
    root, env, _ = stack
    frontend = start_frontend("fp-frontend-2", env, root, "--frontend-processes", "2")
    try:
        wait_until(lambda: len(_listening_children(frontend)) == 2 and all(_listening_children(frontend).values()),
                   120, "two frontend processes", [frontend])
        victim = next(iter(_listening_children(frontend)))
        psutil.Process(victim).send_signal(signal.SIGKILL)
        assert frontend.popen.wait(60) == 1
        assert "exited" in frontend.log_tail()
    finally:
        frontend.stop()


def test_a_taken_port_is_refused_once(stack):
    root, env, _ = stack
    # A port a plain (not SO_REUSEPORT) socket already holds: one clear error, no children started.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = start_frontend("fp-taken", env, root, "--frontend-processes", "2", port=port)
        assert taken.popen.wait(60) == 1
        assert f"--http-port {port}" in taken.log_tail()


def test_the_flag_is_checked():
    with pytest.raises(SystemExit) as exc:
        parse_frontend_args(["--http-port", "0", "--frontend-processes", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_frontend_args(["--frontend-processes", "0"])
    assert parse_frontend_args(["--frontend-processes", "4"]).processes == 4
    assert parse_frontend_args([]).processes == 1

"""The frontend binds loopback by default and every interface when asked (a container's port
must be reachable from outside it); its --config file wins over the environment. Real processes;
no worker is needed (/live answers without one)."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import psutil
import pytest

from tests.integration.procs import Proc, base_env, free_port, start_frontend, stop_all, wait_until


def outside_address() -> str:
    """An IPv4 address of this host that is not loopback (the address another host would dial)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise AssertionError("this host has no IPv4 address beyond loopback: the test cannot tell the binds apart")


def live(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/live", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture
def env(tmp_path):
    return base_env(str(tmp_path / "discovery"))


def test_the_frontend_binds_loopback_by_default_and_every_interface_when_asked(env, tmp_path):
    outside = outside_address()
    env.pop("TURBINE_HTTP_HOST", None)
    default = start_frontend("fe-default", env, tmp_path)
    everywhere = start_frontend("fe-all", dict(env, TURBINE_HTTP_HOST="0.0.0.0"), tmp_path)
    by_flag = start_frontend("fe-flag", env, tmp_path, "--http-host", "0.0.0.0")
    procs = [default, everywhere, by_flag]
    try:
        for p in procs:
            wait_until(lambda p=p: live("127.0.0.1", p.port), 60, f"{p.name} /live", procs)
        assert not live(outside, default.port)
        assert live(outside, everywhere.port)
        assert live(outside, by_flag.port)
    finally:
        stop_all(procs)


def test_the_frontend_config_file_wins_over_the_environment(env, tmp_path):
    env_port, file_port = free_port(), free_port()
    config = tmp_path / "frontend.yaml"
    config.write_text(f"http-port: {file_port}\nhttp-host: 0.0.0.0\n")
    env.update(TURBINE_HTTP_PORT=str(env_port), TURBINE_HTTP_HOST="127.0.0.1")
    # No --http-port flag: the port comes from the file alone.
    log = tmp_path / "fe-config.log"
    fe = Proc("fe-config", subprocess.Popen([sys.executable, "-m", "turbine.frontend", "--config", str(config)],
                                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT), log, file_port)
    procs = [fe]
    try:
        wait_until(lambda: live("127.0.0.1", file_port), 60, "the frontend on the file's port", procs)
        assert live(outside_address(), file_port)  # the file's host, not the environment's
        assert not live("127.0.0.1", env_port)
    finally:
        stop_all(procs)

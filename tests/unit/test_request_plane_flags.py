"""`--request-plane tcp|nats` (and `--nats-server`) on every process that serves or calls the request
plane, from a flag, a --config file or the environment; each builds its servers and clients on it; a bad
value or a combination that would do nothing (TLS files with nats) is refused naming the flag."""

from __future__ import annotations

import pytest

from turbine.config import RequestPlaneConfig
from turbine.frontend.args import parse_frontend_args
from turbine.mocker.args import parse_mocker_args
from turbine.router.args import parse_router_args
from turbine.runtime import request_plane
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer
from turbine.runtime.request_plane_nats import NatsRequestPlaneClient, NatsRequestPlaneServer


def _calibrate(argv):
    from turbine.config import request_plane_from_args
    from turbine.mocker.calibrate import build_parser

    parser = build_parser()
    return request_plane_from_args(parser.parse_args(["--model", "m", "--output", "o", *argv]), parser)


def _worker(argv):
    from turbine.vllm.args import parse_worker_args

    return parse_worker_args(argv).request_plane_config


PROCESSES = {
    "frontend": lambda argv: parse_frontend_args(argv).request_plane,
    "router": lambda argv: parse_router_args(argv).request_plane,
    "mocker": lambda argv: parse_mocker_args(argv).request_plane_config,
    "worker": _worker,
    "mocker-calibrate": _calibrate,
}


@pytest.mark.parametrize("process", list(PROCESSES))
def test_every_process_takes_the_request_plane_from_flag_file_and_environment(process, tmp_path, monkeypatch):
    read = PROCESSES[process]
    monkeypatch.delenv("TURBINE_REQUEST_PLANE", raising=False)
    monkeypatch.delenv("TURBINE_NATS_SERVER", raising=False)
    assert read([]) == RequestPlaneConfig("tcp", "nats://127.0.0.1:4222")
    assert read(["--request-plane", "nats", "--nats-server", "nats://10.0.0.9:4333"]) == RequestPlaneConfig(
        "nats", "nats://10.0.0.9:4333")
    monkeypatch.setenv("TURBINE_REQUEST_PLANE", "nats")
    monkeypatch.setenv("TURBINE_NATS_SERVER", "nats://nats.example:4222")
    assert read([]) == RequestPlaneConfig("nats", "nats://nats.example:4222")
    if process != "mocker-calibrate":  # (a tool, without --config)
        config = tmp_path / "c.yaml"
        config.write_text("request-plane: tcp\n")
        assert read(["--config", str(config)]).kind == "tcp"  # the file beats the environment


@pytest.mark.parametrize("process", list(PROCESSES))
def test_a_bad_request_plane_is_refused_naming_it(process, monkeypatch, capsys):
    read = PROCESSES[process]
    for argv, words in ((["--request-plane", "udp"], "--request-plane"),
                        (["--request-plane", "nats", "--nats-server", "http://x"], "--nats-server")):
        with pytest.raises(SystemExit) as info:
            read(argv)
        assert info.value.code == 2
        assert words in capsys.readouterr().err
    monkeypatch.setenv("TURBINE_REQUEST_PLANE", "udp")
    with pytest.raises(SystemExit) as info:
        read([])
    assert info.value.code == 2 and "TURBINE_REQUEST_PLANE='udp'" in capsys.readouterr().err


@pytest.mark.parametrize("process", ["frontend", "router", "mocker", "worker"])
def test_tls_files_with_the_nats_plane_are_refused(process, tmp_path, capsys):
    """They secure TCP connections; over NATS they would do nothing."""
    files = []
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
        files += [f"--tls-{name}", str(tmp_path / name)]
    with pytest.raises(SystemExit) as info:
        PROCESSES[process](["--request-plane", "nats", *files])
    assert info.value.code == 2
    assert "--tls-cert/--tls-key/--tls-ca secure the tcp request plane" in capsys.readouterr().err


def test_the_config_builds_servers_and_clients_of_its_plane():
    tcp, nats = RequestPlaneConfig("tcp"), RequestPlaneConfig("nats", "nats://10.1.2.3:4222")
    assert type(tcp.server("127.0.0.1", 0)) is RequestPlaneServer and type(tcp.client()) is RequestPlaneClient
    server, client = nats.server("127.0.0.1", 0), nats.client()
    assert isinstance(server, NatsRequestPlaneServer) and isinstance(client, NatsRequestPlaneClient)
    assert server.nats_server == client.nats_server == "nats://10.1.2.3:4222"
    assert tcp.serves("127.0.0.1:5000") and not tcp.serves("nats://h:4222/turbine.rpc.0")
    assert nats.serves("nats://h:4222/turbine.rpc.0") and not nats.serves("127.0.0.1:5000")


def test_parts_that_make_their_own_client_get_the_installed_plane():
    """(A KV router fetching a worker's missed events.)"""
    try:
        RequestPlaneConfig("nats").install()
        assert isinstance(request_plane.new_client(), NatsRequestPlaneClient)
        RequestPlaneConfig("tcp").install()
        assert type(request_plane.new_client()) is RequestPlaneClient
    finally:
        request_plane.install_client_factory(RequestPlaneClient)


def test_serve_gives_the_plane_to_the_frontend_and_the_worker(model_dir, tmp_path):
    from turbine.serve import plan

    p = plan(["--request-plane", "nats", "--nats-server", "nats://10.0.0.1:4222"], str(tmp_path))
    for cmd in (p.frontend_cmd, *p.worker_cmds):
        assert cmd[cmd.index("--request-plane") + 1] == "nats"
        assert cmd[cmd.index("--nats-server") + 1] == "nats://10.0.0.1:4222"

"""The cluster-security flags of every process: a worker or router refuses to listen beyond
loopback without a key (or TLS) unless told --insecure; bad keys and files are named."""

import argparse

import pytest

from tests.tls_certs import make_tls_files
from turbine.frontend.args import parse_frontend_args
from turbine.mocker.args import parse_mocker_args
from turbine.router.args import parse_router_args
from turbine.serve import build_parser, cluster_key_env
from turbine.vllm.args import parse_worker_args

KEY = "0123456789abcdef0123456789abcdef"


def refused(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


ROUTER_HOSTS = ("0.0.0.0", "::", "192.0.2.7", "example.com")


@pytest.mark.parametrize("parse,host", [(parse_mocker_args, "0.0.0.0"), (parse_worker_args, "0.0.0.0"),
                                        *((parse_router_args, h) for h in ROUTER_HOSTS)],
                         ids=["mocker", "vllm", "router-0.0.0.0", "router-::", "router-ip", "router-name"])
def test_listening_beyond_loopback_needs_a_key_or_insecure(parse, host, capsys, monkeypatch):
    monkeypatch.delenv("TURBINE_CLUSTER_KEY", raising=False)
    err = refused(parse, ["--host", host], capsys)
    assert "--host" in err and "beyond loopback" in err
    for flag in ("--cluster-key", "--cluster-key-file", "--tls-cert", "--insecure"):
        assert flag in err
    assert parse(["--host", host, "--insecure"]).host == host
    monkeypatch.setenv("TURBINE_INSECURE", "1")
    assert parse(["--host", host]).security.insecure
    monkeypatch.delenv("TURBINE_INSECURE")
    assert parse(["--host", host, "--cluster-key", KEY]).security.has_key
    monkeypatch.setenv("TURBINE_CLUSTER_KEY", KEY)  # the env does as well as the flag
    assert parse(["--host", host]).security.auth().key == KEY.encode()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host, monkeypatch):
    monkeypatch.delenv("TURBINE_CLUSTER_KEY", raising=False)
    cfg = parse_router_args(["--host", host])
    assert not cfg.security.has_key and cfg.security.auth().key is None


def test_a_key_file_is_read_and_stripped(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    cfg = parse_mocker_args(["--host", "0.0.0.0", "--cluster-key-file", str(path)])
    assert cfg.security.auth().key == KEY.encode()
    assert parse_frontend_args(["--cluster-key-file", str(path)]).security.auth().key == KEY.encode()


@pytest.mark.parametrize("argv,flag,words", [
    (["--cluster-key", "short"], "--cluster-key", "at least 16 bytes"),
    (["--cluster-key-file", "/no/such/key"], "--cluster-key-file", "no such file"),
    (["--cluster-key", KEY, "--cluster-key-file", "/etc/hostname"], "--cluster-key-file", "not both"),
    (["--tls-cert", "/etc/hostname"], "--tls-", "all three"),
])
def test_bad_security_flags_are_named(argv, flag, words, capsys):
    for parse in (parse_mocker_args, parse_frontend_args):
        err = refused(parse, argv, capsys)
        assert flag in err and words in err, err


def test_tls_files_make_the_worker_authenticated(tmp_path, monkeypatch):
    monkeypatch.delenv("TURBINE_CLUSTER_KEY", raising=False)
    cert, key, ca = make_tls_files(tmp_path)
    cfg = parse_mocker_args(["--host", "0.0.0.0", "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca])
    assert cfg.security.auth().tls is not None and cfg.security.auth().key is None


def test_the_frontend_has_no_insecure_flag(capsys):
    """It listens on no internal plane: its HTTP port is the public API (--api-key)."""
    err = refused(parse_frontend_args, ["--insecure"], capsys)
    assert "unrecognized arguments: --insecure" in err


def test_turbine_serve_gives_the_key_to_every_child_through_the_environment(tmp_path):
    parser = build_parser()
    args, _ = parser.parse_known_args(["--cluster-key", KEY])
    assert cluster_key_env(args, parser) == {"TURBINE_CLUSTER_KEY": KEY}
    args, _ = parser.parse_known_args(["--cluster-key-file", "k"])
    assert cluster_key_env(args, parser) == {"TURBINE_CLUSTER_KEY_FILE": str(tmp_path.cwd() / "k")}
    args, _ = parser.parse_known_args([])
    assert cluster_key_env(args, parser) == {}
    with pytest.raises(SystemExit):
        cluster_key_env(argparse.Namespace(cluster_key=KEY, cluster_key_file="k"), parser)

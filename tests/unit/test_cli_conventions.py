"""The command line's conventions, for every process: `turbine --version`; help text on every flag;
a bad TURBINE_* value is one line naming the variable; `--config FILE` (YAML) with flags > file >
environment > defaults; `turbine serve MODEL`, which splits flags between frontend and worker and
sets nothing the user did not give."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from turbine.frontend.args import build_parser as frontend_parser
from turbine.frontend.args import parse_frontend_args
from turbine.mocker.args import build_parser as mocker_parser
from turbine.mocker.args import parse_mocker_args
from turbine.router.args import build_parser as router_parser
from turbine.router.args import parse_router_args
from turbine.serve import build_parser as serve_parser
from turbine.serve import plan

ROOT = Path(__file__).resolve().parents[2]


def vllm_parser():
    from turbine.vllm.args import build_parser

    return build_parser()


def vllm_parser_with_help(monkeypatch):
    """vLLM fills in its flags' help (from its config docstrings) only when the process was started
    with --help (NEEDS_HELP, read at import), and caches the flags' settings."""
    import vllm.engine.arg_utils as arg_utils

    monkeypatch.setattr(arg_utils, "NEEDS_HELP", True)
    arg_utils._compute_kwargs.cache_clear()
    try:
        return vllm_parser()
    finally:
        arg_utils._compute_kwargs.cache_clear()


def calibrate_parser():
    from turbine.mocker.calibrate import build_parser

    return build_parser()


def planner_parser():
    from turbine.planner.config import build_parser

    return build_parser()


def model_parser():
    from turbine.cli import model_parser

    return model_parser()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turbine.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def exits(fn, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        fn()
    assert info.value.code == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------- --version
def test_turbine_version_prints_the_installed_version():
    for flag in ("--version", "-V"):
        done = run_cli(flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"turbine {importlib.metadata.version('turbine')}"


# --------------------------------------------------------------------------- help text
PARSERS = {"frontend": frontend_parser, "mocker": mocker_parser, "router": router_parser, "serve": serve_parser,
           "worker": vllm_parser, "mocker-calibrate": calibrate_parser, "model-prepare": model_parser,
           "planner": planner_parser}


def _walk(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)
        else:
            yield parser.prog, action


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_flag_has_help_text(name, monkeypatch):
    parser = vllm_parser_with_help(monkeypatch) if name == "worker" else PARSERS[name]()
    actions = list(_walk(parser))
    assert len(actions) > 2
    missing = [f"{prog}: {'/'.join(a.option_strings) or a.dest}" for prog, a in actions
               if not (a.help and a.help.strip())]
    assert missing == []


def test_the_help_check_sees_a_flag_without_help(monkeypatch):
    parser = frontend_parser()
    parser.add_argument("--undocumented")
    assert any(not a.help for _, a in _walk(parser))


# --------------------------------------------------------------------------- environment errors
def env_variables() -> dict[str, str]:
    """Every TURBINE_* variable read as an int, a float, a bool or a choice, from the source: name -> kind."""
    found = {}
    for path in (ROOT / "turbine").rglob("*.py"):
        for kind, name in re.findall(r'(?<!\w)env_(int|float|bool|choice)\(\s*"(TURBINE_[A-Z0-9_]+)"', path.read_text()):
            found[name] = kind
    return found


BUILDERS = [frontend_parser, mocker_parser, router_parser, vllm_parser]


def test_the_typed_variables_are_found():
    names = env_variables()
    assert {"TURBINE_HTTP_PORT", "TURBINE_DISCOVERY_TTL", "TURBINE_INSECURE", "TURBINE_MAX_WAITING_REQUESTS",
            "TURBINE_IGNORE_UNKNOWN_FIELDS", "TURBINE_SYSTEM_PORT", "TURBINE_MIGRATION_LIMIT"} <= set(names)


@pytest.mark.parametrize("name,kind", sorted(env_variables().items()))
def test_a_bad_environment_value_is_one_line_naming_the_variable(name, kind, monkeypatch, capsys):
    monkeypatch.setenv(name, "maybe" if kind == "bool" else "lots")
    refused = 0
    for build in BUILDERS:
        try:
            build()
        except SystemExit as exc:
            assert exc.code == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and name in err and "'" in err and "Traceback" not in err, err
            refused += 1
    assert refused >= 1, f"no process reads {name}"


def test_numbers_from_the_environment_go_through_the_typed_helpers():
    """A bare int(os.environ...) would be a traceback again."""
    pattern = re.compile(r"\b(int|float)\(\s*(os\.environ|os\.getenv|env\()")
    offenders = [f"{p.relative_to(ROOT)}:{i + 1}" for p in (ROOT / "turbine").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert offenders == []


@pytest.mark.parametrize("command,variable", [
    (["frontend"], "TURBINE_MAX_INFLIGHT_REQUESTS"), (["router"], "TURBINE_REQUEST_PLANE_PORT"),
    (["mocker"], "TURBINE_KV_TRANSFER_TIMEOUT"), (["serve"], "TURBINE_HTTP_PORT"), (["router"], "TURBINE_INSECURE"),
    (["frontend"], "TURBINE_IGNORE_UNKNOWN_FIELDS")])
def test_the_console_command_reports_a_bad_variable_without_a_traceback(command, variable):
    done = run_cli(*command, env={variable: "lots"})
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert variable in done.stderr and "Traceback" not in done.stderr


def test_booleans_from_the_environment(monkeypatch):
    for word, value in (("1", True), ("true", True), ("ON", True), ("0", False), ("false", False), ("", False)):
        monkeypatch.setenv("TURBINE_IGNORE_UNKNOWN_FIELDS", word)
        assert parse_frontend_args([]).ignore_unknown_fields is value


# --------------------------------------------------------------------------- --config precedence
def write(tmp_path: Path, text: str, name: str = "settings.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("family", ["frontend", "router", "mocker", "worker"])
def test_flags_beat_the_file_beat_the_environment_beat_the_defaults(family, tmp_path, monkeypatch):
    from turbine.vllm.args import parse_worker_args

    parse, flag, var, read, default = {
        "frontend": (parse_frontend_args, "max-inflight-requests", "TURBINE_MAX_INFLIGHT_REQUESTS",
                     lambda c: c.max_inflight_requests, 4096),
        "router": (parse_router_args, "port", "TURBINE_REQUEST_PLANE_PORT", lambda c: c.port, 0),
        "mocker": (parse_mocker_args, "max-waiting-requests", "TURBINE_MAX_WAITING_REQUESTS",
                   lambda c: c.max_waiting_requests, 1024),
        "worker": (parse_worker_args, "max-waiting-requests", "TURBINE_MAX_WAITING_REQUESTS",
                   lambda c: c.max_waiting_requests, 1024),
    }[family]
    monkeypatch.delenv(var, raising=False)
    config = write(tmp_path, f"{flag}: 202\n")
    assert read(parse([])) == default
    monkeypatch.setenv(var, "101")
    assert read(parse([])) == 101
    assert read(parse(["--config", config])) == 202
    assert read(parse([f"--config={config}", f"--{flag}", "303"])) == 303
    assert read(parse([f"--{flag}", "303", "--config", config])) == 303  # the flag wins wherever it stands


def test_the_worker_file_takes_vllm_engine_flags_too(tmp_path):
    from turbine.vllm.args import parse_worker_args

    config = write(tmp_path, "max-model-len: 1024\nenforce-eager: true\ndyn-tool-call-parser: hermes\n"
                             "enable-prefix-caching: false\n")
    cfg = parse_worker_args(["--config", config])
    args = cfg.engine_args
    assert (args.max_model_len, args.enforce_eager, args.enable_prefix_caching) == (1024, True, False)
    assert cfg.tool_call_parser == "hermes"
    assert parse_worker_args(["--config", config, "--max-model-len", "512"]).engine_args.max_model_len == 512


def test_a_switch_set_false_in_the_file_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_IGNORE_UNKNOWN_FIELDS", "1")
    assert parse_frontend_args([]).ignore_unknown_fields
    off = write(tmp_path, "ignore-unknown-fields: false\n")
    assert not parse_frontend_args(["--config", off]).ignore_unknown_fields
    assert parse_frontend_args(["--config", off, "--ignore-unknown-fields"]).ignore_unknown_fields
    monkeypatch.setenv("TURBINE_INSECURE", "1")
    assert parse_router_args(["--host", "0.0.0.0"]).security.insecure
    secure = write(tmp_path, "insecure: false\nhost: 0.0.0.0\n", "router.yaml")
    with pytest.raises(SystemExit):
        parse_router_args(["--config", secure])


def test_file_keys_take_underscores_lists_and_negative_numbers(tmp_path):
    config = write(tmp_path, "router_mode: kv\nrouter-temperature: 0.5\netcd-endpoints: 10.0.0.1:1,10.0.0.2:2\n"
                             "discovery-backend: etcd\n")
    cfg = parse_frontend_args(["--config", config])
    assert cfg.router.mode == "kv" and cfg.router.kv.temperature == 0.5
    assert cfg.discovery.etcd_endpoints == ("10.0.0.1:1", "10.0.0.2:2")


@pytest.mark.parametrize("text,words", [
    ("http-prot: 1\n", "'http-prot': not a setting of python -m turbine.frontend (no flag --http-prot)"),
    ("http-port: many\n", "--http-port: invalid int value: 'many'"),
    ("ignore-unknown-fields: 1\n", "a switch takes true or false"),
    ("api-key:\n", "has no value"),
    ("- http-port\n", "expected a mapping"),
    ("http-port: [1\n", "not valid YAML"),
    ("config: other.yaml\n", "'config': not a setting"),
    ("http-port: [1, 2]\n", "takes one value, not a list"),
])
def test_a_bad_config_file_is_named(text, words, tmp_path, capsys):
    config = write(tmp_path, text)
    err = exits(lambda: parse_frontend_args(["--config", config]), capsys)
    assert words in err.strip().splitlines()[-1], err  # argparse's usage, then the error on one line


def test_a_missing_config_file_is_named(capsys):
    err = exits(lambda: parse_router_args(["--config", "/no/such.yaml"]), capsys)
    assert "--config /no/such.yaml: cannot read it" in err
    err = exits(lambda: parse_mocker_args(["--config"]), capsys)
    assert "--config: expected a file" in err


# --------------------------------------------------------------------------- turbine serve
@pytest.fixture
def model_dir(tmp_path) -> str:
    path = tmp_path / "my-model"
    path.mkdir()
    return str(path)


def test_serve_takes_the_model_as_its_first_argument_or_as_a_flag(model_dir, tmp_path, capsys):
    for argv in ([model_dir], ["--model", model_dir], [model_dir, "--model", model_dir]):
        p = plan([*argv, "--max-model-len", "1024"], str(tmp_path))
        assert p.worker_cmds[0][3:-2] == ["--model", model_dir, "--max-model-len", "1024", "--no-kv-events"]
        assert p.worker_cmds[0][-2:] == ["--system-port", str(p.status_ports[0])]
        assert p.served_name == model_dir
    err = exits(lambda: plan([model_dir, "--model", "other"], str(tmp_path)), capsys)
    assert "the model is given twice" in err


def test_serve_sets_nothing_the_user_did_not_give(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_HTTP_PORT", "9001")
    monkeypatch.setenv("TURBINE_HTTP_HOST", "0.0.0.0")
    monkeypatch.setenv("TURBINE_ROUTER_MODE", "kv")
    p = plan([model_dir], str(tmp_path))
    assert p.frontend_cmd[3:] == []  # the frontend reads its own environment
    assert p.url == "http://127.0.0.1:9001"  # binds every interface; answers on loopback too
    assert p.env == {}


def test_serve_splits_flags_between_frontend_and_worker(model_dir, tmp_path):
    p = plan([model_dir, "--http-port", "9002", "--router-mode", "kv", "--max-model-len", "512", "--namespace",
              "ns1", "--enforce-eager", "--api-key", "k" * 20, "--ignore-unknown-fields"], str(tmp_path))
    assert p.frontend_cmd[3:] == ["--http-port", "9002", "--router-mode", "kv", "--namespace", "ns1",
                                  "--ignore-unknown-fields"]
    assert p.worker_cmds[0][5:-2] == ["--namespace", "ns1", "--max-model-len", "512", "--enforce-eager"]
    assert p.env == {"TURBINE_API_KEY": "k" * 20}  # out of `ps`
    assert p.url == "http://127.0.0.1:9002"


def test_serve_workers_publish_no_kv_events_where_nothing_reads_them(model_dir, tmp_path, monkeypatch):
    """Round-robin (the frontend's default) and random route by no worker's cache, and serve's discovery is
    private: its workers get --no-kv-events. A KV router, a KV-events flag of the user's (or its variable), or a
    discovery another router could share keeps the events."""
    for var in ("TURBINE_ROUTER_MODE", "TURBINE_KV_EVENTS_PORT", "TURBINE_NO_KV_EVENTS", "TURBINE_KV_EVENTS_BUFFER"):
        monkeypatch.delenv(var, raising=False)

    def relays(*argv: str) -> bool:
        cmds = plan([model_dir, *argv], str(tmp_path)).worker_cmds
        assert len({"--no-kv-events" in cmd for cmd in cmds}) == 1  # the same for a prefill and a decode worker
        return "--no-kv-events" not in cmds[0]

    assert not relays() and not relays("--router-mode", "random") and not relays("--disagg")
    assert relays("--router-mode", "kv") and relays("--router-mode", "kv", "--disagg")
    assert not relays("--router-mode", "kv", "--no-router-kv-events")  # predicts caches from its own routing
    assert relays("--kv-events-buffer", "64") and relays("--kv-events-port", "20000")
    assert relays("--discovery-backend", "etcd") and relays("--discovery-dir", str(tmp_path / "shared"))
    assert plan([model_dir, "--no-kv-events"], str(tmp_path)).worker_cmds[0].count("--no-kv-events") == 1
    config = write(tmp_path, "kv-events-buffer: 64\n", "worker.yaml")
    assert relays("--config", config)
    monkeypatch.setenv("TURBINE_KV_EVENTS_PORT", "20000")
    assert relays()
    monkeypatch.delenv("TURBINE_KV_EVENTS_PORT")
    monkeypatch.setenv("TURBINE_ROUTER_MODE", "kv")
    assert relays()


def test_serve_default_binds_loopback(model_dir, tmp_path, monkeypatch):
    for var in ("TURBINE_HTTP_HOST", "TURBINE_HTTP_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert plan([model_dir], str(tmp_path)).url == "http://127.0.0.1:8000"


def test_serve_config_file_goes_to_each_process_with_flags_winning(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_HTTP_PORT", "9001")
    config = write(tmp_path, f"model: {model_dir}\nhttp-port: 9005\nmax-model-len: 700\nnamespace: ns2\n"
                             "disagg: true\napi-key: from-the-file-0123\n", "serve.yaml")
    workdir = tmp_path / "work"
    workdir.mkdir()
    p = plan(["--config", config], str(workdir))
    assert p.url == "http://127.0.0.1:9005" and p.model == model_dir and p.disagg
    assert p.env == {"TURBINE_API_KEY": "from-the-file-0123"}
    import yaml

    fe_file = p.frontend_cmd[p.frontend_cmd.index("--config") + 1]
    assert yaml.safe_load(open(fe_file)) == {"http-port": 9005, "namespace": "ns2"}
    wk_file = p.worker_cmds[0][p.worker_cmds[0].index("--config") + 1]
    assert yaml.safe_load(open(wk_file)) == {"max-model-len": 700, "namespace": "ns2"}
    assert [cmd[-2:] for cmd in p.worker_cmds] == [["--disaggregation-mode", "prefill"],
                                                    ["--disaggregation-mode", "decode"]]
    assert p.served_name == model_dir
    with open(config, "a") as f:
        f.write("served_model_name: from-the-file\n")
    assert plan(["--config", config], str(workdir)).served_name == "from-the-file"  # what serve waits for
    assert plan(["--config", config, "--served-model-name", "flag"], str(workdir)).served_name == "flag"
    p = plan(["--config", config, "--http-port", "9006", "--api-key", "from-the-flag-0123"], str(workdir))
    assert p.url == "http://127.0.0.1:9006" and p.env == {"TURBINE_API_KEY": "from-the-flag-0123"}
    assert p.frontend_cmd[-2:] == ["--http-port", "9006"]  # after its --config: the flag wins


def test_serve_checks_frontend_flags_before_starting_anything(model_dir, tmp_path, capsys):
    err = exits(lambda: plan([model_dir, "--router-mode", "best"], str(tmp_path)), capsys)
    assert "--router-mode" in err
    err = exits(lambda: plan([model_dir, "--http-port", "0"], str(tmp_path)), capsys)
    assert "--http-port 0" in err


def test_serve_refuses_kvbm_with_disagg_before_starting_anything(model_dir, tmp_path, capsys):
    # Both workers would get kvbm and the decode worker refuses it only after the prefill engine loaded.
    for flags in (["--connector", "kvbm", "nixl"], ["--connector=nixl,kvbm"]):
        err = exits(lambda: plan([model_dir, "--disagg", *flags, "--kv-host-cache-gb", "1"], str(tmp_path)), capsys)
        assert "--connector kvbm with --disagg" in err and "--disaggregation-mode prefill" in err
    config = write(tmp_path, "connector: [kvbm, nixl]\n", "w.yaml")
    err = exits(lambda: plan([model_dir, "--disagg", "--config", config], str(tmp_path)), capsys)
    assert "--connector kvbm with --disagg" in err
    assert plan([model_dir, "--connector", "kvbm", "--kv-host-cache-gb", "1"], str(tmp_path)).worker_cmds  # aggregated


def test_serve_gives_each_worker_a_status_port_after_the_http_port(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TURBINE_SYSTEM_PORT", raising=False)
    import socket

    with socket.socket() as taken:  # a port in use is skipped
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        p = plan([model_dir, "--http-port", str(busy - 1)], str(tmp_path))
        assert p.status_ports[0] > busy and p.worker_cmds[0][-2:] == ["--system-port", str(p.status_ports[0])]
        p = plan([model_dir, "--http-port", str(busy - 1), "--disagg"], str(tmp_path))
        assert len(set(p.status_ports)) == 2 and min(p.status_ports) > busy
        for cmd, port in zip(p.worker_cmds, p.status_ports):
            assert cmd[-4:-2] == ["--system-port", str(port)]  # before --disaggregation-mode
    # The user's port (flag, config file, environment) is kept, and nothing is added.
    p = plan([model_dir, "--system-port", "9100"], str(tmp_path))
    assert p.status_ports == [9100] and p.worker_cmds[0].count("--system-port") == 1
    p = plan(["--config", write(tmp_path, f"model: {model_dir}\nsystem-port: 9101\n", "s.yaml")], str(tmp_path))
    assert p.status_ports == [9101] and "--system-port" not in p.worker_cmds[0]
    monkeypatch.setenv("TURBINE_SYSTEM_PORT", "9102")
    p = plan([model_dir], str(tmp_path))
    assert p.status_ports == [9102] and "--system-port" not in p.worker_cmds[0]


def test_serve_passes_logging_and_tracing_to_every_child_through_the_environment(model_dir, tmp_path, monkeypatch,
                                                                                capsys):
    p = plan([model_dir, "--log-level", "DEBUG", "--log-format", "json", "--otlp-traces-endpoint", "h:4317"],
             str(tmp_path))
    assert p.env == {"TURBINE_LOG_LEVEL": "debug", "TURBINE_LOG_FORMAT": "json",
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "h:4317"}
    assert not {"--log-level", "--log-format", "--otlp-traces-endpoint"} & {*p.frontend_cmd, *p.worker_cmds[0]}
    config = write(tmp_path, f"model: {model_dir}\nlog-level: warning\nlog_format: json\n"
                             "otlp-traces-endpoint: f:4317\n", "obs.yaml")
    p = plan(["--config", config, "--log-format", "text"], str(tmp_path))  # the flag wins over the file
    assert p.env == {"TURBINE_LOG_LEVEL": "warning", "TURBINE_LOG_FORMAT": "text",
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "f:4317"}
    assert "--config" not in p.frontend_cmd and "--config" not in p.worker_cmds[0]  # nothing else in the file
    monkeypatch.setenv("TURBINE_LOG_FORMAT", "xml")
    err = exits(lambda: plan([model_dir], str(tmp_path)), capsys)
    assert "TURBINE_LOG_FORMAT" in err and err.count("\n") == 1


def test_a_config_file_sets_each_process_logging_and_tracing(tmp_path, monkeypatch):
    """setup_logging / setup_tracing read these before the process's parser runs: its --config file too."""
    from turbine.logging_setup import logging_choices
    from turbine.tracing import configured_endpoint

    for var in ("TURBINE_LOG_LEVEL", "TURBINE_LOG", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TURBINE_LOG_FORMAT", "text")
    config = write(tmp_path, "log-level: DEBUG\nlog_format: json\notlp-traces-endpoint: http://c:4317\n"
                             "max-model-len: 512\n", "proc.yaml")
    assert logging_choices(["--config", config]) == ("debug", "json")  # the file beats the environment
    assert logging_choices([f"--config={config}", "--log-level", "error"]) == ("error", "json")  # the flag wins
    assert configured_endpoint(["--config", config]) == "http://c:4317"
    assert configured_endpoint(["--config", config, "--otlp-traces-endpoint", "f:1"]) == "f:1"
    assert logging_choices(["--config", str(tmp_path / "missing.yaml")]) == ("info", "text")  # the parser names it
    # Each process's parser takes the keys (an accepted key is one these early reads apply).
    for build in (frontend_parser, mocker_parser, router_parser):
        parser = build()
        for opt in ("--log-level", "--log-format", "--otlp-traces-endpoint"):
            assert opt in parser._option_string_actions, (parser.prog, opt)


def test_serve_stop_leaves_no_grandchild_behind(tmp_path):
    # A worker stopped while its engine starts exits on SIGTERM and leaves its EngineCore process
    # behind; serve's stop must take the child's whole process group with it.
    import signal as signal_mod
    import time

    from turbine.serve import _stop

    pid_file = tmp_path / "grandchild"
    script = ("import signal, subprocess, sys\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              "signal.pause()\n")
    child = subprocess.Popen([sys.executable, "-c", script], preexec_fn=os.setpgrp)
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    _stop([child])
    def alive() -> bool:
        try:
            return Path(f"/proc/{grandchild}/stat").read_text().split()[2] != "Z"  # Z: dead, not yet reaped
        except FileNotFoundError:
            return False

    for _ in range(100):
        if not alive():
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, signal_mod.SIGKILL)
        raise AssertionError("the grandchild outlived serve's stop")


_FAKE_FRONTEND = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"models": {"m": {}}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
# A worker that drains for argv[1] seconds on SIGTERM, then says so in the file argv[2].
_DRAINING_WORKER = """
import pathlib, signal, sys, time
def drain(*args):
    time.sleep(float(sys.argv[1]))
    pathlib.Path(sys.argv[2]).write_text("drained")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
signal.pause()
"""


@pytest.mark.parametrize("second,drain_s", [("SIGINT", 60.0), ("SIGTERM", 1.0)])
def test_serve_signalled_again_while_stopping_leaves_nothing_running(tmp_path, second, drain_s):
    # Ctrl-C pressed twice, or `timeout` (which signals its child, then the child's whole process group): serve's
    # real main loop over a stand-in frontend and a worker that drains slowly. A second Ctrl-C kills what is left at
    # once; a second SIGTERM lets the worker drain. Either way serve exits and takes every child with it (the second
    # signal used to cut the stop short and leave the frontend serving without serve).
    import signal as signal_mod
    import socket
    import time

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drained = tmp_path / "drained"
    script = (
        "import sys\nimport turbine.serve as serve\n"
        f"fe = [sys.executable, '-c', {_FAKE_FRONTEND!r}, '{port}']\n"
        f"worker = [sys.executable, '-c', {_DRAINING_WORKER!r}, '{drain_s}', {str(drained)!r}]\n"
        "serve.plan = lambda argv, workdir: serve.ServePlan(\n"
        f"    model='m', served_name='m', url='http://127.0.0.1:{port}', frontend_cmd=fe, worker_cmds=[worker],\n"
        "    env={}, disagg=False, status_ports=[])\n"
        "sys.exit(serve.main([]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal_mod.signal(signal_mod.SIGINT, signal_mod.SIG_DFL))
    children = []
    try:
        for line in proc.stdout:
            if line.startswith("[turbine] ready"):
                break
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2
        first = signal_mod.SIGINT if second == "SIGINT" else signal_mod.SIGTERM
        proc.send_signal(first)
        time.sleep(0.5)  # serve is now waiting for the worker to drain
        proc.send_signal(getattr(signal_mod, second))
        assert proc.wait(timeout=drain_s / 2 + 10) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.cmdline()[:3] for c in alive]
        assert drained.exists() == (second == "SIGTERM")
    finally:
        proc.kill()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass

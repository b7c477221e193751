"""Every flag Turbine adds to a worker (the vLLM worker's own flags, not vLLM's engine flags; every mocker
flag) has an environment form by one naming rule, TURBINE_<FLAG> ("--kv-events-port" ->
TURBINE_KV_EVENTS_PORT), found by walking the parsers; a value that cannot be read is one line naming
the variable; --kv-events-port is range-checked, names itself, and is refused where nothing is relayed."""

from __future__ import annotations

import argparse

import pytest

from turbine.flag_sources import env_name
from turbine.mocker.args import build_parser as mocker_parser

SKIPPED = {"--help", "--config"}
# The observability flags have their own variables (TURBINE_LOG_LEVEL, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
OBSERVABILITY = {"--log-level", "--log-format", "--otlp-traces-endpoint"}


def vllm_worker_parser():
    from turbine.vllm.args import build_parser

    return build_parser()


def turbine_flags_of_the_vllm_worker(parser) -> list[argparse.Action]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllms = set(AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions)
    return [a for a in parser._actions if a.option_strings and not set(a.option_strings) & vllms]


def sample(action: argparse.Action):
    """(the variable's value, what the parser should then hold) for one flag."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)) and not action.default:
        return "1", True
    if isinstance(action, argparse.BooleanOptionalAction):
        return "0", False
    if isinstance(action, argparse._StoreFalseAction):  # --no-X: TURBINE_NO_X=1 turns X off
        return "1", False
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if action.nargs in ("+", "*"):
        return "first second", ["first", "second"]
    if action.type is int:
        return "1234", 1234
    if action.type is float:
        return "2.5", 2.5
    return "from-the-environment", "from-the-environment"


def own_flags(parser, walk) -> list[argparse.Action]:
    return [a for a in walk(parser) if a.option_strings and a.option_strings[0] not in SKIPPED
            and not set(a.option_strings) & OBSERVABILITY and a.option_strings[0].startswith("--")]


@pytest.mark.parametrize("worker", ["mocker", "vllm"])
def test_every_flag_turbine_adds_to_a_worker_has_its_environment_variable(worker, monkeypatch):
    build = mocker_parser if worker == "mocker" else vllm_worker_parser
    walk = (lambda p: p._actions) if worker == "mocker" else turbine_flags_of_the_vllm_worker
    flags = own_flags(build(), walk)
    assert len(flags) > 30 and any(a.option_strings[0] == "--kv-events-port" for a in flags) == (worker == "vllm")
    missing = []
    for action in flags:
        name = env_name(action.option_strings[0])
        value, expected = sample(action)
        monkeypatch.setenv(name, value)
        parsed = getattr(build().parse_args([]), action.dest)
        monkeypatch.delenv(name)
        if parsed != expected:
            missing.append(f"{action.option_strings[0]} ({name}={value!r}: got {parsed!r})")
    assert missing == []


def test_the_command_line_beats_the_environment(monkeypatch):
    monkeypatch.setenv("TURBINE_NUM_GPU_BLOCKS", "99")
    assert mocker_parser().parse_args([]).num_gpu_blocks == 99
    assert mocker_parser().parse_args(["--num-gpu-blocks", "7"]).num_gpu_blocks == 7


def test_a_value_that_cannot_be_read_is_one_line_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("TURBINE_NUM_GPU_BLOCKS", "lots")
    with pytest.raises(SystemExit) as info:
        mocker_parser()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TURBINE_NUM_GPU_BLOCKS='lots': expected a value for --num-gpu-blocks" in err


@pytest.mark.parametrize("argv,words", [
    (["--kv-events-port", "80"], "--kv-events-port): 80: must be between 1024 and 65535"),
    (["--kv-events-port", "65535", "--data-parallel-size", "2"], "must be between 1024 and 65534"),
    (["--kv-events-port", "20080", "--no-enable-prefix-caching"], "relays no KV events"),
    (["--kv-events-port", "20080", "--disaggregation-mode", "decode", "--connector", "nixl"], "relays no KV events"),
])
def test_the_kv_event_port_is_range_checked_and_refused_where_inert(argv, words, capsys):
    from turbine.vllm.args import parse_worker_args

    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_the_kv_event_port_from_the_flag_or_its_variable(monkeypatch):
    from turbine.vllm.args import parse_worker_args

    assert parse_worker_args(["--kv-events-port", "20080"]).kv_events_port == 20080
    monkeypatch.setenv("TURBINE_KV_EVENTS_PORT", "20090")
    assert parse_worker_args([]).kv_events_port == 20090

"""Where a flag's value comes from, for every Turbine process: the command line wins over a
`--config FILE` (YAML), which wins over the TURBINE_* environment, which wins over the default.

The environment is read when a parser is built (its values become the parser's defaults), so an
environment variable with a value that cannot be read stops the process with one line naming it
(`env_errors`). A config file is turned into flags placed ahead of the command line's own, so the
parser checks its values like typed flags, and the command line, parsed after it, wins."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

FALSE_WORDS = ("", "0", "false", "no", "off")
TRUE_WORDS = ("1", "true", "yes", "on")


class EnvVarError(ValueError):
    """An environment variable has a value that cannot be read; the message names it."""

    def __init__(self, name: str, value: str, expected: str):
        super().__init__(f"environment variable {name}={value!r}: expected {expected}")
        self.name = name


def env_str(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def env_int(name: str, default: int | None) -> int | None:
    """An integer from `name`; unset or empty: `default`."""
    value = os.environ.get(name, "")
    if value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvVarError(name, value, "an integer") from None


def env_float(name: str, default: float | None) -> float | None:
    value = os.environ.get(name, "")
    if value.strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise EnvVarError(name, value, "a number") from None


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of `choices` from `name`; unset or empty: `default`."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in choices:
        raise EnvVarError(name, value, f"one of {', '.join(choices)}")
    return value


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in FALSE_WORDS:
        return False
    if word in TRUE_WORDS:
        return True
    raise EnvVarError(name, value, "1/true/yes/on or 0/false/no/off")


ENV_PREFIX = "TURBINE_"


def env_name(option: str) -> str:
    """The naming rule of flags' environment variables: "--kv-events-port" -> "TURBINE_KV_EVENTS_PORT"."""
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def env_forms(actions) -> None:
    """Give each flag among `actions` (argparse actions: a process's own flags) its environment variable by
    the naming rule, as a default the command line and a --config file override. A value that cannot be
    read raises EnvVarError naming the variable (env_errors turns it into one line). Flags whose default
    already came from the environment under another name keep it (documented aliases)."""
    for action in actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or longs[0] in ("--help", "--config"):
            continue
        name = env_name(longs[0])
        value = os.environ.get(name)
        if value is None or value.strip() == "":
            continue
        action.default = _env_value(action, name, value)


def _env_value(action, name: str, value: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        on = env_bool(name)
        return (not on) if isinstance(action, argparse._StoreFalseAction) else on
    if action.nargs == 0:  # other switches (e.g. store_const): not settable from a word
        raise EnvVarError(name, value, f"nothing: {action.option_strings[0]} takes no value")
    words = value.replace(",", " ").split() if action.nargs in ("+", "*") else [value]
    out = []
    for word in words:
        try:
            item = action.type(word) if callable(action.type) else word
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise EnvVarError(name, value, f"a value for {action.option_strings[0]}") from None
        if action.choices is not None and item not in action.choices:
            raise EnvVarError(name, value, f"one of {', '.join(map(str, action.choices))}")
        out.append(item)
    return out if action.nargs in ("+", "*") else out[0]


@contextlib.contextmanager
def env_errors(prog: str):
    """Within (building a parser): an EnvVarError exits with status 2 and one line naming the variable,
    as argparse reports a bad flag, instead of a traceback."""
    try:
        yield
    except EnvVarError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


CONFIG_HELP = ("YAML file of settings: keys are flag names without '--' (e.g. 'http-port: 8001'; a switch takes "
               "true/false, a list flag a list). Flags on the command line win over it; it wins over TURBINE_* "
               "environment variables")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None, help=CONFIG_HELP)


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config FILE given, or None; argv without it)."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise ValueError("--config: give one config file")
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise ValueError("--config: expected a file")
                path, i = argv[i + 1], i + 2
            else:
                path, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    return path, rest


def load_config_file(path: str) -> dict:
    """The file's mapping of settings; ValueError names what is wrong with it."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got a {type(data).__name__}")
    return data


def config_file_tokens(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """The settings of `flags` (e.g. "--log-level") in argv's --config FILE, as flags to place ahead of
    argv, for a process that reads a few settings before its parser runs (its logging, its tracing).
    A file that cannot be read gives none here: the process's parser then reports it."""
    try:
        path, _ = split_config_arg(argv)
        settings = load_config_file(path) if path else {}
    except ValueError:
        return []
    return [f"{config_key_flag(key)}={_scalar(value)}" for key, value in settings.items()
            if config_key_flag(key) in flags and value is not None and not isinstance(value, (dict, list, bool))]


def config_key_flag(key: object) -> str:
    return "--" + str(key).removeprefix("--").replace("_", "-")


def config_tokens(parser: argparse.ArgumentParser, path: str, settings: dict) -> list[str]:
    """The settings as command-line flags of `parser`. A switch set to false that has no --no-
    form becomes the parser's default instead (so `insecure: false` overrides TURBINE_INSECURE=1)."""
    tokens: list[str] = []
    for key, value in settings.items():
        opt = config_key_flag(key)
        action = parser._option_string_actions.get(opt)
        where = f"--config {path}: {key!r}"
        if action is None or opt in ("--config", "--help", "--version"):
            raise ValueError(f"{where}: not a setting of {parser.prog} (no flag {opt})")
        if value is None:
            raise ValueError(f"{where}: has no value; give one or leave the key out")
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise ValueError(f"{where}: a switch takes true or false, not {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(opt if value else f"--no-{opt[2:]}")
            elif value:
                tokens.append(opt)
            elif isinstance(action.const, bool):
                parser.set_defaults(**{action.dest: not action.const})
            continue
        if isinstance(value, list):
            if isinstance(action, argparse._AppendAction):
                for item in value:
                    tokens.append(f"{opt}={_scalar(item)}")
            elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
                tokens += [opt, *map(_scalar, value)]
            else:
                raise ValueError(f"{where}: takes one value, not a list")
            continue
        tokens.append(f"{opt}={_scalar(value)}")
    return tokens


def _scalar(value: object) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)  # vLLM's JSON-valued flags (e.g. --compilation-config)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """argv with the settings of its --config FILE (if any) placed ahead of its own flags, for
    `parser.parse_args`: the command line is parsed last, so it wins. Errors exit through the parser."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        path, rest = split_config_arg(argv)
        if path is None:
            return rest
        return config_tokens(parser, path, load_config_file(path)) + rest
    except ValueError as exc:
        parser.error(str(exc))

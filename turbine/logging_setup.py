"""Logging for every Turbine process: the level and format from `--log-level` / `--log-format`
(env TURBINE_LOG_LEVEL / TURBINE_LOG_FORMAT), and the id of the request being served in every
line logged while serving it (a contextvar: set by the frontend for each HTTP request and by the
request plane for each stream a worker or router serves).

`text` lines: `TIME LEVEL LOGGER: MESSAGE [request_id=ID]`. `json` lines: one object per line
with `time` (ISO 8601, UTC), `level`, `logger`, `message`, and when known `request_id`,
`trace_id` / `span_id` (the OpenTelemetry span current when the line was logged), `exc_info`,
plus the fields a caller passes in `extra={"fields": {...}}` (the access log's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextvars import ContextVar

import msgspec

from turbine.flag_sources import config_file_tokens

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# The request this task is serving (None: none). Tasks copy contextvars when created, so a value
# set in a request's task is seen by everything it awaits or starts, and by nothing else.
request_id_var: ContextVar[str | None] = ContextVar("turbine_request_id", default=None)


def add_logging_args(parser: argparse.ArgumentParser, level: bool = True) -> None:
    """--log-level and --log-format (read early by setup_logging; declared here for --help).
    `level=False`: the parser has a --log-level of its own (vLLM's, which then sets both)."""
    g = parser.add_argument_group("Logging")
    if level:
        g.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, default=None,
                       help="least severe level logged (env TURBINE_LOG_LEVEL; default info)")
    g.add_argument("--log-format", choices=LOG_FORMATS, type=str.lower, default=None,
                   help="text lines, or one JSON object per line for log collectors (env TURBINE_LOG_FORMAT; "
                        "default text)")


def logging_choices(argv: list[str] | None, prog: str = "turbine") -> tuple[str, str]:
    """(level, format) from the flags in `argv`, else its --config file, else the environment, else
    info/text. A bad value exits 2 with a one-line error naming the flag or the variable."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    add_logging_args(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    # The file's settings go ahead of the command line's: parsed later, a flag wins.
    args, _ = parser.parse_known_args(config_file_tokens(argv, ("--log-level", "--log-format")) + argv)
    level = args.log_level or _env_choice("TURBINE_LOG_LEVEL", LOG_LEVELS, parser) \
        or _env_choice("TURBINE_LOG", LOG_LEVELS, parser) or "info"  # TURBINE_LOG: the older name
    fmt = args.log_format or _env_choice("TURBINE_LOG_FORMAT", LOG_FORMATS, parser) or "text"
    return level, fmt


def _env_choice(name: str, choices: tuple[str, ...], parser: argparse.ArgumentParser) -> str | None:
    value = os.environ.get(name, "").strip().lower()
    if value and value not in choices:
        # One line naming the variable (argparse's error would print the usage of flags not given).
        print(f"{parser.prog}: error: environment variable {name}={os.environ[name]!r}: must be one of "
              f"{', '.join(choices)}", file=sys.stderr)
        raise SystemExit(2)
    return value or None


def setup_logging(argv: list[str] | None = None, prog: str = "turbine") -> None:
    """Configure the root logger from `argv`'s --log-level / --log-format (None: sys.argv) and the
    environment. Call first thing in a process's main."""
    level, fmt = logging_choices(argv, prog)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # vLLM configures its own "vllm" logger with its own handler; JSON lines from our processes
    # should not be interleaved with its text: route it through ours (it keeps its level).
    if fmt == "json":
        vllm_logger = logging.getLogger("vllm")
        vllm_logger.handlers = [handler]
        vllm_logger.propagate = False
    os.environ["TURBINE_LOG_FORMAT"] = fmt  # children (e.g. vLLM's engine processes) log alike
    os.environ["TURBINE_LOG_LEVEL"] = level


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = request_id_var.get()
        return line if request_id is None else f"{line} [request_id={request_id}]"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (msgspec's encoder: a third of json.dumps's cost on the access log's
    lines; anything it cannot encode is written as its str())."""

    _second = -1
    _stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # strftime once a second, not once a line
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        out = {
            "time": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            out["request_id"] = request_id
        from turbine import tracing  # here: logging_setup is imported first by every process

        ids = tracing.current_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return _encode(out).decode()


_encode = msgspec.json.Encoder(enc_hook=str).encode

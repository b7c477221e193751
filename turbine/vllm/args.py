"""Worker command line: every vLLM engine flag (vLLM's own parser) plus Turbine's flags,
turned into one typed WorkerConfig."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from turbine.config import DEFAULT_NAMESPACE, DiscoveryConfig, add_discovery_args, discovery_config_from_args

ENDPOINT_TYPES = ("chat", "completions")


@dataclass(frozen=True)
class WorkerConfig:
    namespace: str
    component: str
    endpoint: str
    served_model_name: str
    model_path: str  # what the engine loads (local folder or hub id)
    discovery: DiscoveryConfig
    host: str  # request-plane bind address
    port: int
    system_host: str
    system_port: int | None
    endpoint_types: tuple[str, ...]
    tool_call_parser: str | None
    reasoning_parser: str | None
    custom_jinja_template: str | None
    migration_limit: int
    graceful_shutdown_timeout: float
    engine_args: object  # vllm AsyncEngineArgs (typed loosely so this module imports without vLLM)


def build_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m turbine.vllm",
                                    description="Turbine vLLM worker: token-in/token-out generation.")
    group = parser.add_argument_group("Turbine worker")
    env = os.environ.get
    group.add_argument("--namespace", default=env("TURBINE_NAMESPACE", DEFAULT_NAMESPACE))
    group.add_argument("--component", default=env("TURBINE_COMPONENT", "backend"))
    group.add_argument("--endpoint", default=env("TURBINE_ENDPOINT", "generate"),
                       help="endpoint name, or a full 'namespace.component.endpoint' (dyn:// prefix allowed)")
    group.add_argument("--host", default=env("TURBINE_REQUEST_PLANE_HOST", "127.0.0.1"),
                       help="request-plane bind address")
    group.add_argument("--port", type=int, default=int(env("TURBINE_REQUEST_PLANE_PORT", "0")),
                       help="request-plane port (0 = any free port)")
    group.add_argument("--system-host", default=env("TURBINE_SYSTEM_HOST", "127.0.0.1"))
    group.add_argument("--system-port", type=int, default=_opt_int(env("TURBINE_SYSTEM_PORT")),
                       help="port of the status server (/health, /live, /metrics); off when unset")
    group.add_argument("--endpoint-types", default=env("TURBINE_ENDPOINT_TYPES", "chat,completions"),
                       help="comma-separated subset of: chat, completions")
    group.add_argument("--dyn-tool-call-parser", default=env("TURBINE_TOOL_CALL_PARSER"))
    group.add_argument("--dyn-reasoning-parser", default=env("TURBINE_REASONING_PARSER"))
    group.add_argument("--custom-jinja-template", default=env("TURBINE_CUSTOM_JINJA_TEMPLATE"))
    group.add_argument("--migration-limit", type=int, default=int(env("TURBINE_MIGRATION_LIMIT", "0")))
    group.add_argument("--graceful-shutdown-timeout", type=float,
                       default=float(env("TURBINE_GRACEFUL_SHUTDOWN_TIMEOUT", "30")),
                       help="seconds in-flight requests may take to finish after SIGTERM")
    add_discovery_args(parser)
    parser = AsyncEngineArgs.add_cli_args(parser)
    # No --model means the embedded default model (prepared on first use).
    parser.set_defaults(model=None)
    return parser


def _opt_int(value: str | None) -> int | None:
    return int(value) if value else None


def parse_worker_args(argv: list[str] | None = None) -> WorkerConfig:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from turbine.model.prepare import DEFAULT_MODEL, resolve

    parser = build_parser()
    args = parser.parse_args(argv)

    namespace, component, endpoint = args.namespace, args.component, args.endpoint
    if "." in endpoint or endpoint.startswith("dyn://"):
        parts = endpoint.removeprefix("dyn://").split(".")
        if len(parts) != 3 or not all(parts):
            parser.error(f"--endpoint {args.endpoint!r}: expected NAME or namespace.component.endpoint")
        namespace, component, endpoint = parts
    for flag, value in (("--namespace", namespace), ("--component", component), ("--endpoint", endpoint)):
        if not value or "/" in value or not value.replace("-", "").replace("_", "").isalnum():
            parser.error(f"{flag} {value!r}: use letters, digits, '-' and '_' only")

    types = tuple(t.strip() for t in args.endpoint_types.split(",") if t.strip())
    bad = [t for t in types if t not in ENDPOINT_TYPES]
    if bad or not types:
        parser.error(f"--endpoint-types {args.endpoint_types!r}: choose from {', '.join(ENDPOINT_TYPES)}")
    if args.custom_jinja_template:
        path = os.path.abspath(os.path.expanduser(args.custom_jinja_template))
        if not os.path.isfile(path):
            parser.error(f"--custom-jinja-template {args.custom_jinja_template!r}: no such file")
        args.custom_jinja_template = path
    for flag, port in (("--port", args.port), ("--system-port", args.system_port)):
        if port is not None and not 0 <= port <= 65535:
            parser.error(f"{flag} {port}: must be between 0 and 65535")
    if args.migration_limit < 0:
        parser.error("--migration-limit must be >= 0")
    if args.graceful_shutdown_timeout < 0:
        parser.error("--graceful-shutdown-timeout must be >= 0")

    served = args.served_model_name
    if isinstance(served, list):
        if len(served) > 1:
            parser.error("--served-model-name: Turbine workers serve exactly one name")
        served = served[0] if served else None
    embedded = args.model is None or args.model == DEFAULT_MODEL
    try:
        args.model = resolve(args.model)
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    if not served:
        served = DEFAULT_MODEL if embedded else args.model
    args.served_model_name = served
    # Prefix caching is on unless the user turned it off explicitly.
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = True

    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(f"invalid vLLM engine arguments: {exc}")
    # Turbine detokenizes in the frontend; the engine still needs its tokenizer for EOS.
    engine_args.skip_tokenizer_init = False
    engine_args.disable_log_stats = False

    return WorkerConfig(
        namespace=namespace, component=component, endpoint=endpoint,
        served_model_name=served, model_path=args.model,
        discovery=discovery_config_from_args(args, parser),
        host=args.host, port=args.port, system_host=args.system_host, system_port=args.system_port,
        endpoint_types=types, tool_call_parser=args.dyn_tool_call_parser,
        reasoning_parser=args.dyn_reasoning_parser, custom_jinja_template=args.custom_jinja_template,
        migration_limit=args.migration_limit, graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        engine_args=engine_args,
    )

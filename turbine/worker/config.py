"""Flags and settings that every worker-kind process shares (the vLLM worker, the mocker):
where it registers, where it listens, and what its model card tells the frontend."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from turbine.config import DEFAULT_NAMESPACE, DiscoveryConfig, add_discovery_args, discovery_config_from_args
from turbine.protocol.discovery import DISAGGREGATION_MODES, ModelCard
from turbine.runtime.event_plane import DEFAULT_NATS_SERVER, EVENT_PLANES
from turbine.runtime.event_plane_nats import parse_server
from turbine.runtime.kv_publisher import DEFAULT_REPLAY_BUFFER

ENDPOINT_TYPES = ("chat", "completions")


@dataclass(frozen=True)
class ServingConfig:
    namespace: str
    component: str
    endpoint: str
    served_model_name: str
    model_path: str  # what --model resolved to: a local folder or a hub id
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
    event_plane: str  # "zmq" | "nats": how KV events and load metrics reach routers
    nats_server: str  # with --event-plane nats
    kv_events_buffer: int  # recent KV event batches kept for routers that missed some
    disaggregation_mode: str  # "agg" | "prefill" | "decode"
    kv_transfer_timeout: float  # decode: seconds to wait for a prefill worker's KV, then prefill here

    @property
    def is_prefill(self) -> bool:
        return self.disaggregation_mode == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.disaggregation_mode == "decode"

    def model_card(self, instance_id: str, *, engine: str, tokenizer_path: str, context_length: int,
                   kv_block_size: int, total_kv_blocks: int, max_num_seqs: int,
                   max_num_batched_tokens: int, kv_events_address: str | None = None) -> ModelCard:
        """The card of one instance: our settings plus what the engine reports about itself."""
        return ModelCard(
            name=self.served_model_name, namespace=self.namespace, component=self.component,
            endpoint=self.endpoint, instance_id=instance_id, engine=engine,
            tokenizer_path=tokenizer_path, chat_template_path=self.custom_jinja_template,
            context_length=context_length, kv_block_size=kv_block_size, total_kv_blocks=total_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            endpoint_types=list(self.endpoint_types), tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser, migration_limit=self.migration_limit,
            kv_events_address=kv_events_address, disaggregation_mode=self.disaggregation_mode,
        )


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Turbine worker")
    env = os.environ.get
    group.add_argument("--namespace", default=env("TURBINE_NAMESPACE", DEFAULT_NAMESPACE))
    group.add_argument("--component", default=env("TURBINE_COMPONENT"),
                       help="component it registers as (default: 'prefill' for prefill workers, else 'backend')")
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
    group.add_argument("--event-plane", default=env("TURBINE_EVENT_PLANE", "zmq"),
                       help="how KV events and load metrics reach routers: zmq (each worker binds a PUB "
                            "socket) or nats (through the NATS server of --nats-server, for many hosts)")
    group.add_argument("--nats-server", default=env("TURBINE_NATS_SERVER", DEFAULT_NATS_SERVER),
                       help="NATS server for --event-plane nats (nats://HOST:PORT)")
    group.add_argument("--kv-events-buffer", type=int,
                       default=int(env("TURBINE_KV_EVENTS_BUFFER", str(DEFAULT_REPLAY_BUFFER))),
                       help="recent KV event batches kept (up to 8 MiB) to replay to a router that missed "
                            "some; beyond them it gets a snapshot of the whole cache")
    group.add_argument("--disaggregation-mode", default=env("TURBINE_DISAGGREGATION_MODE"),
                       help="agg (whole requests, the default), prefill (compute prompts' KV for decode "
                            "workers) or decode (generate from KV that a prefill worker computed)")
    group.add_argument("--is-prefill-worker", action="store_true", help="same as --disaggregation-mode prefill")
    group.add_argument("--is-decode-worker", action="store_true", help="same as --disaggregation-mode decode")
    group.add_argument("--kv-transfer-timeout", type=float,
                       default=float(env("TURBINE_KV_TRANSFER_TIMEOUT", "30")),
                       help="decode workers: seconds to wait for a prefill worker's KV before computing "
                            "the prompt here instead")
    add_discovery_args(parser)


def disaggregation_mode_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """--disaggregation-mode and its two aliases; flags that disagree are an error naming them."""
    said = {}
    if args.disaggregation_mode is not None:
        if args.disaggregation_mode not in DISAGGREGATION_MODES:
            parser.error(f"--disaggregation-mode {args.disaggregation_mode!r}: choose from "
                         f"{', '.join(DISAGGREGATION_MODES)}")
        said[f"--disaggregation-mode {args.disaggregation_mode}"] = args.disaggregation_mode
    if args.is_prefill_worker:
        said["--is-prefill-worker"] = "prefill"
    if args.is_decode_worker:
        said["--is-decode-worker"] = "decode"
    if len(set(said.values())) > 1:
        parser.error(f"{' and '.join(said)} contradict each other: give one role")
    return next(iter(said.values()), "agg")


def _opt_int(value: str | None) -> int | None:
    return int(value) if value else None


def serving_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser,
                             served_model_name: str | None) -> ServingConfig:
    """Validate the flags of `add_serving_args` and resolve `args.model`; a bad flag exits with
    a message naming it. No --model means the embedded default model (prepared on first use),
    served under its short name."""
    from turbine.model.prepare import DEFAULT_MODEL, resolve

    mode = disaggregation_mode_from_args(args, parser)
    if args.kv_transfer_timeout <= 0:
        parser.error("--kv-transfer-timeout must be > 0")
    default_component = "prefill" if mode == "prefill" else "backend"
    namespace, component, endpoint = args.namespace, args.component or default_component, args.endpoint
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
    template = args.custom_jinja_template
    if template:
        template = os.path.abspath(os.path.expanduser(template))
        if not os.path.isfile(template):
            parser.error(f"--custom-jinja-template {args.custom_jinja_template!r}: no such file")
    for flag, port in (("--port", args.port), ("--system-port", args.system_port)):
        if port is not None and not 0 <= port <= 65535:
            parser.error(f"{flag} {port}: must be between 0 and 65535")
    if args.migration_limit < 0:
        parser.error("--migration-limit must be >= 0")
    if args.graceful_shutdown_timeout < 0:
        parser.error("--graceful-shutdown-timeout must be >= 0")
    if args.event_plane not in EVENT_PLANES:
        parser.error(f"--event-plane {args.event_plane!r}: choose from {', '.join(EVENT_PLANES)}")
    try:
        nats_server = parse_server(args.nats_server)
    except ValueError as exc:
        parser.error(f"--nats-server {exc}")
    if args.kv_events_buffer < 0:
        parser.error("--kv-events-buffer must be >= 0")

    embedded = args.model is None or args.model == DEFAULT_MODEL
    try:
        model_path = resolve(args.model)
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    served_model_name = served_model_name or (DEFAULT_MODEL if embedded else model_path)

    return ServingConfig(
        namespace=namespace, component=component, endpoint=endpoint,
        served_model_name=served_model_name, model_path=model_path,
        discovery=discovery_config_from_args(args, parser),
        host=args.host, port=args.port, system_host=args.system_host, system_port=args.system_port,
        endpoint_types=types, tool_call_parser=args.dyn_tool_call_parser,
        reasoning_parser=args.dyn_reasoning_parser, custom_jinja_template=template,
        migration_limit=args.migration_limit, graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        event_plane=args.event_plane, nats_server=nats_server, kv_events_buffer=args.kv_events_buffer,
        disaggregation_mode=mode, kv_transfer_timeout=args.kv_transfer_timeout,
    )

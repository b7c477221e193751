"""Flags and settings that every worker-kind process shares (the vLLM worker, the mocker):
where it registers, where it listens, and what its model card tells the frontend.

ServingConfig checks itself when built (so a config made in code is checked like one made
from flags); `serving_fields_from_args` only reads the flags."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Literal, get_args

from turbine.config import (
    DEFAULT_NAMESPACE,
    REQUEST_PLANES,
    ClusterSecurityConfig,
    DiscoveryConfig,
    RequestPlaneConfig,
    add_cluster_security_args,
    add_request_plane_args,
    add_discovery_args,
    check,
    cluster_security_from_args,
    config_errors_to,
    discovery_config_from_args,
    flag,
)
from turbine.flag_sources import env_float, env_int, env_str
from turbine.model.prepare import DEFAULT_MODEL, resolve
from turbine.protocol.lora import lora_name_problem
from turbine.protocol.encode import IMAGE_ENCODE
from turbine.protocol.discovery import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, ModelCard
from turbine.runtime.event_plane import DEFAULT_NATS_SERVER, EVENT_PLANES
from turbine.runtime.event_plane_nats import parse_server
from turbine.worker import health_check
from turbine.worker.admission import Admission
from turbine.worker.kv_publisher import DEFAULT_REPLAY_BUFFER
from turbine.worker.worker_metrics import WorkerMetrics

ENDPOINT_TYPES = ("chat", "completions")
# What a pooling worker serves (the vLLM worker with --runner pooling): /v1/embeddings only.
EMBEDDINGS = "embeddings"
# "agg" serves whole requests; "prefill" computes prompts' KV for decode workers to pull;
# "decode" generates from KV that a prefill worker computed.
DisaggregationMode = Literal["agg", "prefill", "decode"]
DISAGGREGATION_MODES: tuple[DisaggregationMode, ...] = get_args(DisaggregationMode)
EventPlaneKind = Literal["zmq", "nats"]
# Overload control's defaults: generous enough that a worker refuses only when it is far behind
# (its queue then takes many seconds to drain), small enough that a flood cannot queue unbounded.
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_QUEUED_PREFILL_TOKENS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ServingConfig:
    namespace: str = flag("--namespace", default=DEFAULT_NAMESPACE)
    component: str = flag("--component", default="backend")
    endpoint: str = flag("--endpoint", default="generate")
    served_model_name: str
    model_path: str  # what --model resolved to: a local folder or a hub id
    discovery: DiscoveryConfig
    host: str = flag("--host", default="127.0.0.1")  # request-plane bind address
    port: int = flag("--port", default=0)
    system_host: str = flag("--system-host", default="127.0.0.1")
    system_port: int | None = flag("--system-port", default=None)
    endpoint_types: tuple[str, ...] = flag("--endpoint-types", default=ENDPOINT_TYPES)
    tool_call_parser: str | None = flag("--dyn-tool-call-parser", default=None)
    reasoning_parser: str | None = flag("--dyn-reasoning-parser", default=None)
    custom_jinja_template: str | None = flag("--custom-jinja-template", default=None)
    migration_limit: int = flag("--migration-limit", default=0)
    graceful_shutdown_timeout: float = flag("--graceful-shutdown-timeout", default=30.0)
    # How load reports and KV events reach routers.
    event_plane: EventPlaneKind = flag("--event-plane", default="zmq")
    # How requests reach it: "tcp" (its --host/--port) or "nats" (RequestPlaneConfig).
    request_plane: str = flag("--request-plane", default="tcp")
    nats_server: str = flag("--nats-server", default=DEFAULT_NATS_SERVER)  # with --event-plane / --request-plane nats
    # Recent KV event batches kept for routers that missed some.
    kv_events_buffer: int = flag("--kv-events-buffer", default=DEFAULT_REPLAY_BUFFER)
    disaggregation_mode: DisaggregationMode = flag("--disaggregation-mode", default="agg")
    # Decode: seconds to wait for a prefill worker's KV, then prefill here.
    kv_transfer_timeout: float = flag("--kv-transfer-timeout", default=30.0)
    security: ClusterSecurityConfig = ClusterSecurityConfig()  # the cluster key, TLS, --insecure
    # Overload control (turbine/worker/admission.py): past either bound a new request is refused
    # with OVERLOADED and the frontend tries another worker. 0 turns a bound off.
    max_waiting_requests: int = flag("--max-waiting-requests", default=DEFAULT_MAX_WAITING_REQUESTS)
    max_queued_prefill_tokens: int = flag("--max-queued-prefill-tokens", default=DEFAULT_MAX_QUEUED_PREFILL_TOKENS)
    # LoRA adapters loaded at start, (name, source URI) pairs (turbine/worker/lora.py); those
    # loaded at run time are not brought back by a restart.
    lora_modules: tuple[tuple[str, str], ...] = flag("--lora-modules", default=())
    # The health canary's request (turbine/worker/health_check.py), a JSON object of request fields;
    # None: the role's default.
    health_check_payload: dict | None = flag(health_check.FLAG, default=None)

    def __post_init__(self):
        for name in ("namespace", "component", "endpoint"):
            value = getattr(self, name)
            check(self, bool(value) and "/" not in value and value.replace("-", "").replace("_", "").isalnum(),
                  name, f"{value!r}: use letters, digits, '-' and '_' only")
        check(self, bool(self.endpoint_types) and set(self.endpoint_types) <= {*ENDPOINT_TYPES, EMBEDDINGS, IMAGE_ENCODE},
              "endpoint_types", f"{','.join(self.endpoint_types)!r}: choose from {', '.join(ENDPOINT_TYPES)}")
        check(self, EMBEDDINGS not in self.endpoint_types or tuple(self.endpoint_types) == (EMBEDDINGS,),
              "endpoint_types", f"{EMBEDDINGS!r} is served alone, by a pooling worker (--runner pooling)")
        check(self, IMAGE_ENCODE not in self.endpoint_types or tuple(self.endpoint_types) == (IMAGE_ENCODE,),
              "endpoint_types", f"{IMAGE_ENCODE!r} is served alone, by an encode worker (--multimodal-encode-worker)")
        check(self, self.custom_jinja_template is None or os.path.isfile(self.custom_jinja_template),
              "custom_jinja_template", f"{self.custom_jinja_template!r}: no such file")
        for name in ("port", "system_port"):
            port = getattr(self, name)
            check(self, port is None or 0 <= port <= 65535, name, f"{port}: must be between 0 and 65535")
        check(self, self.migration_limit >= 0, "migration_limit", "must be >= 0")
        check(self, self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSER_NAMES,
              "tool_call_parser", f"{self.tool_call_parser!r}: choose from {', '.join(TOOL_CALL_PARSER_NAMES)}")
        check(self, self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSER_NAMES,
              "reasoning_parser", f"{self.reasoning_parser!r}: choose from {', '.join(REASONING_PARSER_NAMES)}")
        check(self, self.graceful_shutdown_timeout >= 0, "graceful_shutdown_timeout", "must be >= 0")
        check(self, self.event_plane in EVENT_PLANES, "event_plane",
              f"{self.event_plane!r}: choose from {', '.join(EVENT_PLANES)}")
        try:
            parse_server(self.nats_server)
        except ValueError as exc:
            check(self, False, "nats_server", str(exc))
        check(self, self.request_plane in REQUEST_PLANES, "request_plane",
              f"{self.request_plane!r}: choose from {', '.join(REQUEST_PLANES)}")
        self.request_plane_config.check_security(self, self.security)
        check(self, self.kv_events_buffer >= 0, "kv_events_buffer", "must be >= 0")
        check(self, self.disaggregation_mode in DISAGGREGATION_MODES, "disaggregation_mode",
              f"{self.disaggregation_mode!r}: choose from {', '.join(DISAGGREGATION_MODES)}")
        check(self, self.kv_transfer_timeout > 0, "kv_transfer_timeout", "must be > 0")
        self.security.check_listen(self, "host", self.host)  # the request plane and the zmq event plane
        for name in ("max_waiting_requests", "max_queued_prefill_tokens"):
            check(self, getattr(self, name) >= 0, name, "must be >= 0 (0: no bound)")
        names = [name for name, _ in self.lora_modules]
        for name in names:
            problem = lora_name_problem(name)
            check(self, problem is None, "lora_modules", problem or "")
            check(self, name != self.served_model_name, "lora_modules", f"{name!r} is the served model's name")
        check(self, len(set(names)) == len(names), "lora_modules", "an adapter name is given twice")
        if self.health_check_payload is not None:
            try:
                health_check.check_payload(self.health_check_payload)
            except health_check.PayloadError as exc:
                check(self, False, "health_check_payload", str(exc))

    @property
    def request_plane_config(self) -> RequestPlaneConfig:
        """Its request plane (both fields checked by __post_init__)."""
        return RequestPlaneConfig(kind=self.request_plane, nats_server=self.nats_server)

    def admission(self, metrics: WorkerMetrics | None = None) -> Admission:
        """The worker's overload control with these bounds."""
        return Admission(self.max_waiting_requests or None, self.max_queued_prefill_tokens or None, metrics)

    @property
    def is_prefill(self) -> bool:
        return self.disaggregation_mode == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.disaggregation_mode == "decode"

    def model_card(self, instance_id: str, *, engine: str, tokenizer_path: str, context_length: int,
                   kv_block_size: int, total_kv_blocks: int, max_num_seqs: int,
                   max_num_batched_tokens: int, kv_events_address: str | None = None,
                   load_metrics_address: str | None = None, data_parallel_size: int = 1,
                   model_input: str = "tokens", accepts_prompt_embeds: bool = False,
                   multimodal: bool = False, image_token_id: int | None = None, endpoint_types: list[str] | None = None,
                   image_placeholder: tuple[list[int], tuple[int, int]] | None = None,
                   kv_shared_tier: str | None = None,
                   takes_image_embeddings: bool = False, node_group: str | None = None,
                   output_modalities: list[str] | None = None) -> ModelCard:
        """The card of one instance: our settings plus what the engine reports about itself
        (`endpoint_types`: what the engine turned out to serve, when not our setting)."""
        return ModelCard(
            name=self.served_model_name, namespace=self.namespace, component=self.component,
            endpoint=self.endpoint, instance_id=instance_id, engine=engine,
            tokenizer_path=tokenizer_path, chat_template_path=self.custom_jinja_template,
            context_length=context_length, kv_block_size=kv_block_size, total_kv_blocks=total_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            endpoint_types=endpoint_types or list(self.endpoint_types), tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser, migration_limit=self.migration_limit,
            kv_events_address=kv_events_address, load_metrics_address=load_metrics_address,
            disaggregation_mode=self.disaggregation_mode, data_parallel_size=data_parallel_size,
            model_input=model_input,
            accepts_prompt_embeds=accepts_prompt_embeds, multimodal=multimodal,
            image_token_id=image_token_id,
            image_placeholder=image_placeholder[0] if image_placeholder else None,
            image_placeholder_range=image_placeholder[1] if image_placeholder else None,
            kv_shared_tier=kv_shared_tier,
            takes_image_embeddings=takes_image_embeddings, node_group=node_group,
            output_modalities=output_modalities,
        )


def add_serving_args(parser: argparse.ArgumentParser, reasoning_parser_alias: bool = True) -> None:
    """`reasoning_parser_alias`: also define vLLM's spelling --reasoning-parser (the vLLM
    worker leaves it to vLLM's own parser, which defines it, and reads it from there)."""
    group = parser.add_argument_group("Turbine worker")
    env = env_str
    group.add_argument("--namespace", default=env("TURBINE_NAMESPACE", DEFAULT_NAMESPACE),
                       help=f"namespace it registers in (env TURBINE_NAMESPACE; default {DEFAULT_NAMESPACE})")
    group.add_argument("--component", default=env("TURBINE_COMPONENT"),
                       help="component it registers as (env TURBINE_COMPONENT; default: 'prefill' for prefill "
                            "workers, else 'backend')")
    group.add_argument("--endpoint", default=env("TURBINE_ENDPOINT", "generate"),
                       help="endpoint name, or a full 'namespace.component.endpoint' (dyn:// prefix allowed; "
                            "env TURBINE_ENDPOINT)")
    group.add_argument("--host", default=env("TURBINE_REQUEST_PLANE_HOST", "127.0.0.1"),
                       help="request-plane bind address (env TURBINE_REQUEST_PLANE_HOST; default 127.0.0.1)")
    group.add_argument("--port", type=int, default=env_int("TURBINE_REQUEST_PLANE_PORT", 0),
                       help="request-plane port (0 = any free port; env TURBINE_REQUEST_PLANE_PORT)")
    group.add_argument("--system-host", default=env("TURBINE_SYSTEM_HOST", "127.0.0.1"),
                       help="bind address of the status server (env TURBINE_SYSTEM_HOST; default 127.0.0.1)")
    group.add_argument("--system-port", type=int, default=env_int("TURBINE_SYSTEM_PORT", None),
                       help="port of the status server (/health, /live, /metrics); off when unset "
                            "(env TURBINE_SYSTEM_PORT)")
    group.add_argument("--endpoint-types", default=env("TURBINE_ENDPOINT_TYPES", "chat,completions"),
                       help="comma-separated subset of: chat, completions (env TURBINE_ENDPOINT_TYPES)")
    group.add_argument("--dyn-tool-call-parser", "--tool-call-parser", dest="dyn_tool_call_parser",
                       default=env("TURBINE_TOOL_CALL_PARSER"),
                       help=f"how the frontend finds tool calls in this model's output: "
                            f"{', '.join(TOOL_CALL_PARSER_NAMES)} (none: tool_choice auto is refused)")
    group.add_argument("--dyn-reasoning-parser", dest="dyn_reasoning_parser", default=env("TURBINE_REASONING_PARSER"),
                       help=f"how the frontend separates reasoning from the answer: "
                            f"{', '.join(REASONING_PARSER_NAMES)}")
    if reasoning_parser_alias:
        group.add_argument("--reasoning-parser", dest="reasoning_parser", default=None,
                           help="vLLM's spelling of --dyn-reasoning-parser")
    group.add_argument("--custom-jinja-template", default=env("TURBINE_CUSTOM_JINJA_TEMPLATE"),
                       help="a chat-template file that replaces the tokenizer's (env TURBINE_CUSTOM_JINJA_TEMPLATE)")
    group.add_argument("--migration-limit", type=int, default=env_int("TURBINE_MIGRATION_LIMIT", 0),
                       help="times the frontend may move a request of this model to another worker when its "
                            "worker fails (in the model card; a frontend's own --migration-limit overrides it)")
    group.add_argument("--graceful-shutdown-timeout", type=float,
                       default=env_float("TURBINE_GRACEFUL_SHUTDOWN_TIMEOUT", 30.0),
                       help="seconds in-flight requests may take to finish after SIGTERM")
    group.add_argument("--event-plane", default=env("TURBINE_EVENT_PLANE", "zmq"),
                       help="how KV events and load metrics reach routers: zmq (each worker binds a PUB "
                            "socket) or nats (through the NATS server of --nats-server, for many hosts)")
    group.add_argument("--nats-server", default=env("TURBINE_NATS_SERVER", DEFAULT_NATS_SERVER),
                       help="NATS server of --event-plane nats and --request-plane nats (nats://HOST:PORT; env "
                            "TURBINE_NATS_SERVER)")
    add_request_plane_args(group, nats_server=False)
    group.add_argument(health_check.FLAG, default=env(health_check.ENV),
                       help="the request the health canary sends through this worker's own path, as JSON or @FILE: "
                            "a generate request's fields (token_ids, text, sampling, stop, ...) or, for a pooling "
                            "worker, an embed request's (inputs); default one greedy token after the tokenizer's "
                            f"BOS token (text mode: the text \"{health_check.TEXT_PROMPT}\") (env {health_check.ENV})")
    group.add_argument("--kv-events-buffer", type=int,
                       default=env_int("TURBINE_KV_EVENTS_BUFFER", DEFAULT_REPLAY_BUFFER),
                       help="recent KV event batches kept (up to 8 MiB) to replay to a router that missed "
                            "some; beyond them it gets a snapshot of the whole cache")
    group.add_argument("--disaggregation-mode", default=env("TURBINE_DISAGGREGATION_MODE"),
                       help="agg (whole requests, the default), prefill (compute prompts' KV for decode "
                            "workers) or decode (generate from KV that a prefill worker computed)")
    group.add_argument("--is-prefill-worker", action="store_true", help="same as --disaggregation-mode prefill")
    group.add_argument("--is-decode-worker", action="store_true", help="same as --disaggregation-mode decode")
    group.add_argument("--kv-transfer-timeout", type=float,
                       default=env_float("TURBINE_KV_TRANSFER_TIMEOUT", 30.0),
                       help="decode workers: seconds to wait for a prefill worker's KV before computing "
                            "the prompt here instead")
    group.add_argument("--max-waiting-requests", type=int,
                       default=env_int("TURBINE_MAX_WAITING_REQUESTS", DEFAULT_MAX_WAITING_REQUESTS),
                       help="refuse new requests (error 'overloaded': the frontend tries another worker) while "
                            "this many accepted requests have no first token yet; 0: no bound")
    group.add_argument("--max-queued-prefill-tokens", type=int,
                       default=env_int("TURBINE_MAX_QUEUED_PREFILL_TOKENS", DEFAULT_MAX_QUEUED_PREFILL_TOKENS),
                       help="refuse new requests ('overloaded') whose prompt would take the prompt tokens "
                            "waiting to be computed past this; 0: no bound")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to load at start (as vLLM spells it): NAME=SOURCE (a folder, "
                            "file:// or hf:// URI) or JSON {\"name\": ..., \"path\": ...}; needs an engine that "
                            "takes adapters (vLLM: --enable-lora)")
    add_discovery_args(parser)
    add_cluster_security_args(parser)


def lora_modules_from_args(values: list[str] | None, parser: argparse.ArgumentParser) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=SOURCE or JSON {"name", "path"} (vLLM's two spellings)."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                parser.error(f"--lora-modules {value!r}: JSON must be an object with 'name' and 'path'")
            if not isinstance(name, str) or not isinstance(path, str):
                parser.error(f"--lora-modules {value!r}: 'name' and 'path' must be strings")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                parser.error(f"--lora-modules {value!r}: expected NAME=SOURCE")
        modules.append((name, path))
    return tuple(modules)


def disaggregation_mode_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """--disaggregation-mode and its two aliases; flags that disagree are an error naming them
    (the value itself is checked by ServingConfig)."""
    said = {}
    if args.disaggregation_mode is not None:
        said[f"--disaggregation-mode {args.disaggregation_mode}"] = args.disaggregation_mode
    if args.is_prefill_worker:
        said["--is-prefill-worker"] = "prefill"
    if args.is_decode_worker:
        said["--is-decode-worker"] = "decode"
    if len(set(said.values())) > 1:
        parser.error(f"{' and '.join(said)} contradict each other: give one role")
    return next(iter(said.values()), "agg")


def serving_fields_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser,
                             served_model_name: str | None) -> dict:
    """The ServingConfig fields the flags give (and `args.model` resolved), for the constructor of
    ServingConfig or a subclass, which checks them; a flag that cannot be read exits naming it.
    No --model means the embedded default model (prepared on first use), served under its short name."""
    mode = disaggregation_mode_from_args(args, parser)
    default_component = "prefill" if mode == "prefill" else "backend"
    namespace, component, endpoint = args.namespace, args.component or default_component, args.endpoint
    if "." in endpoint or endpoint.startswith("dyn://"):
        parts = endpoint.removeprefix("dyn://").split(".")
        if len(parts) != 3 or not all(parts):
            parser.error(f"--endpoint {args.endpoint!r}: expected NAME or namespace.component.endpoint")
        namespace, component, endpoint = parts
    types = tuple(t.strip() for t in args.endpoint_types.split(",") if t.strip())
    reasoning = args.dyn_reasoning_parser
    alias = getattr(args, "reasoning_parser", None) or None  # vLLM's spelling ("" is its unset)
    if alias and reasoning and alias != reasoning:
        parser.error(f"--dyn-reasoning-parser {reasoning} and --reasoning-parser {alias} contradict each other")
    reasoning = reasoning or alias
    template = args.custom_jinja_template
    if template:
        template = os.path.abspath(os.path.expanduser(template))
    nats_server = args.nats_server
    try:
        nats_server = parse_server(args.nats_server)
    except ValueError:
        pass  # ServingConfig names the flag

    embedded = args.model is None or args.model == DEFAULT_MODEL
    try:
        model_path = resolve(args.model)
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    served_model_name = served_model_name or (DEFAULT_MODEL if embedded else model_path)
    return dict(
        namespace=namespace, component=component, endpoint=endpoint,
        served_model_name=served_model_name, model_path=model_path,
        discovery=discovery_config_from_args(args, parser),
        host=args.host, port=args.port, system_host=args.system_host, system_port=args.system_port,
        endpoint_types=types, tool_call_parser=args.dyn_tool_call_parser,
        reasoning_parser=reasoning, custom_jinja_template=template,
        migration_limit=args.migration_limit, graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        event_plane=args.event_plane, request_plane=args.request_plane, nats_server=nats_server,
        kv_events_buffer=args.kv_events_buffer,
        disaggregation_mode=mode, kv_transfer_timeout=args.kv_transfer_timeout,
        security=cluster_security_from_args(args, parser),
        max_waiting_requests=args.max_waiting_requests, max_queued_prefill_tokens=args.max_queued_prefill_tokens,
        lora_modules=lora_modules_from_args(getattr(args, "lora_modules", None), parser),
        health_check_payload=health_check_payload_from_args(args, parser),
    )


def health_check_payload_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict | None:
    try:
        return health_check.read_payload(args.health_check_payload)
    except health_check.PayloadError as exc:
        parser.error(f"{health_check.FLAG} (or {health_check.ENV}): {exc}")


def checked(cls, parser: argparse.ArgumentParser, **fields):
    """`cls(**fields)`, a ConfigError exiting through the parser with its message."""
    with config_errors_to(parser):
        return cls(**fields)

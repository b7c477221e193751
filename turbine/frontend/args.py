"""Frontend command line → FrontendConfig."""

from __future__ import annotations

import argparse

from turbine.config import (
    add_cluster_security_args,
    add_discovery_args,
    add_request_plane_args,
    cluster_security_from_args,
    config_errors_to,
    discovery_config_from_args,
    request_plane_from_args,
)
from turbine.flag_sources import add_config_arg, env_bool, env_errors, env_float, env_int, env_str, with_config_file
from turbine.frontend.apis.state_store import STORE_KINDS, StoreConfig
from turbine.frontend.app import DEFAULT_MAX_INFLIGHT_REQUESTS, FrontendConfig
from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.dispatch.migration import MigrationConfig
from turbine.frontend.models.busy_queue import BusyConfig
from turbine.frontend.models.pools import POOL_FLAG, parse_pool
from turbine.frontend.preprocess.media import MediaConfig
from turbine.frontend.preprocess.prompt_embeds import DEFAULT_MAX_PROMPT_EMBEDS_BYTES
from turbine.logging_setup import add_logging_args
from turbine.protocol.encode import EMBEDDING_TRANSPORTS
from turbine.router.config import add_kv_router_args
from turbine.router.policy import router_config_from_args, router_modes
from turbine.tracing import add_tracing_args


def add_frontend_args(parser: argparse.ArgumentParser, *, default_port: int = 8000) -> None:
    env = env_str
    g = parser.add_argument_group("Turbine frontend")
    g.add_argument("--http-host", default=env("TURBINE_HTTP_HOST", "127.0.0.1"),
                   help="address the OpenAI HTTP server binds (env TURBINE_HTTP_HOST; default 127.0.0.1, this host "
                        "only; 0.0.0.0 (or ::) binds every interface, as in a container)")
    g.add_argument("--http-port", type=int, default=env_int("TURBINE_HTTP_PORT", default_port),
                   help=f"port of the OpenAI HTTP server (env TURBINE_HTTP_PORT; default {default_port})")
    g.add_argument("--router-mode", choices=router_modes(), default=env("TURBINE_ROUTER_MODE", "round-robin"),
                   help="how a request picks its worker: round-robin, random, or kv (KV-cache aware; see the kv "
                        "flags) (env TURBINE_ROUTER_MODE; default round-robin)")
    add_kv_router_args(g, scope="kv mode: ")
    g.add_argument("--namespace", default=env("TURBINE_NAMESPACE"),
                   help="serve only models registered in this namespace (default: all)")
    g.add_argument("--api-key", default=env("TURBINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/* (env TURBINE_API_KEY); "
                        "several keys separated by commas, each seeing only the stored responses and "
                        "conversations it created")
    g.add_argument("--max-request-bytes", type=int, default=env_int("TURBINE_MAX_REQUEST_BYTES", 8 << 20),
                   help="larger request bodies get HTTP 413 (env TURBINE_MAX_REQUEST_BYTES)")
    g.add_argument("--max-prompt-embeds-bytes", type=int,
                   default=env_int("TURBINE_MAX_PROMPT_EMBEDS_BYTES", DEFAULT_MAX_PROMPT_EMBEDS_BYTES),
                   help="largest /v1/completions prompt_embeds tensor file (decoded bytes); larger get HTTP 400")
    g.add_argument("--ignore-unknown-fields", action="store_true",
                   default=env_bool("TURBINE_IGNORE_UNKNOWN_FIELDS"),
                   help="drop request fields this server does not implement (a warning per field name) "
                        "instead of answering 400 (env TURBINE_IGNORE_UNKNOWN_FIELDS=1)")
    g.add_argument("--max-inflight-requests", type=int,
                   default=env_int("TURBINE_MAX_INFLIGHT_REQUESTS", DEFAULT_MAX_INFLIGHT_REQUESTS),
                   help="generation requests served at once; more get 503 'overloaded' with Retry-After")
    g.add_argument("--overload-retry-after", type=int, default=env_int("TURBINE_OVERLOAD_RETRY_AFTER", 1),
                   help="seconds in the Retry-After header of a 503 'overloaded' (every worker refused the "
                        "request, or --max-inflight-requests was reached)")
    g.add_argument("--busy-threshold-requests", type=int, default=env_int("TURBINE_BUSY_THRESHOLD_REQUESTS", None),
                   help="a worker with this many requests of this frontend in flight is busy: new requests go "
                        "to workers that are not, and wait in a FIFO queue while every worker is (their wait "
                        "counts in TTFT; default: off)")
    g.add_argument("--busy-threshold-prompt-tokens", type=int,
                   default=env_int("TURBINE_BUSY_THRESHOLD_PROMPT_TOKENS", None),
                   help="a worker is busy for a request whose prompt would take the prompt tokens of this "
                        "frontend's requests in flight there past this (an idle worker takes any prompt; as "
                        "--busy-threshold-requests; bounds the prefill an aggregated engine takes while it "
                        "decodes; default: off)")
    g.add_argument("--busy-queue-size", type=int, default=env_int("TURBINE_BUSY_QUEUE_SIZE", None),
                   help="requests that may wait for a worker below the busy thresholds; more get 503 "
                        "'overloaded' (default 1024; needs a --busy-threshold-* flag)")
    g.add_argument("--frontend-processes", type=int, default=env_int("TURBINE_FRONTEND_PROCESSES", 1),
                   help="processes serving the one HTTP port (SO_REUSEPORT), each a whole frontend with its own "
                        "router, metrics and --max-inflight-requests (env TURBINE_FRONTEND_PROCESSES)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction,
                   default=env_bool("TURBINE_ACCESS_LOG", True),
                   help="one line per HTTP request on the logger turbine.access: client, method, path, status, "
                        "duration, request id; the probes /health and /live at DEBUG (env TURBINE_ACCESS_LOG=0 turns "
                        "it off; default on)")
    gr = parser.add_argument_group("Turbine global router (one endpoint over several deployments)")
    gr.add_argument(POOL_FLAG, action="append", default=None, metavar="NAME=NAMESPACE[@DISCOVERY]",
                    help="a pool of workers to route over, given twice or more: the workers of NAMESPACE in this "
                         "frontend's discovery, or in another (@file:DIR, @etcd:HOST:PORT[,HOST:PORT]); each request "
                         "goes to the pool holding the cheapest worker by the KV router's cost (needs --router-mode "
                         "kv), and fails over to the others when a pool has no live worker")
    mm = parser.add_argument_group("Turbine frontend: images in chats (image_url parts; models whose workers run "
                                   "with --enable-multimodal)")
    mm.add_argument("--max-image-bytes", type=int, default=env_int("TURBINE_MAX_IMAGE_BYTES", MediaConfig.max_image_bytes),
                    help="largest image file, fetched or in a data: URL (larger: HTTP 400)")
    mm.add_argument("--max-image-pixels", type=int,
                    default=env_int("TURBINE_MAX_IMAGE_PIXELS", MediaConfig.max_image_pixels),
                    help="largest image, width x height (checked from its header, before decoding)")
    mm.add_argument("--max-images-per-request", type=int,
                    default=env_int("TURBINE_MAX_IMAGES_PER_REQUEST", MediaConfig.max_images),
                    help="images one chat request may hold")
    mm.add_argument("--media-fetch-timeout", type=float,
                    default=env_float("TURBINE_MEDIA_FETCH_TIMEOUT", MediaConfig.fetch_timeout_s),
                    help="seconds one image URL may take to fetch, redirects included")
    mm.add_argument("--media-max-redirects", type=int,
                    default=env_int("TURBINE_MEDIA_MAX_REDIRECTS", MediaConfig.max_redirects),
                    help="redirects an image URL may take")
    mm.add_argument("--allow-private-media-urls", action="store_true",
                    default=env_bool("TURBINE_ALLOW_PRIVATE_MEDIA_URLS"),
                    help="let image URLs reach private, loopback, link-local and other non-global addresses "
                         "(default: refused, so that clients cannot reach the operator's network through the "
                         "frontend)")
    mm.add_argument("--frontend-decoding", action="store_true", default=env_bool("TURBINE_FRONTEND_DECODING"),
                    help="send workers each image's decoded pixels (a uint8 array) instead of its file: the "
                         "frontend decodes once and workers decode nothing (env TURBINE_FRONTEND_DECODING)")
    d = parser.add_argument_group("Turbine frontend: disaggregated prefill/decode (when prefill workers exist)")
    d.add_argument("--max-local-prefill-length", type=int,
                   default=env_int("TURBINE_MAX_LOCAL_PREFILL_LENGTH", DisaggConfig.max_local_prefill_length),
                   help="prompts with fewer tokens not yet cached on the decode worker are prefilled there "
                        "(0: every prompt goes to a prefill worker); default from benchmarks/disagg/disagg.py "
                        "--part crossover")
    d.add_argument("--prefill-timeout", type=float,
                   default=env_float("TURBINE_PREFILL_TIMEOUT", DisaggConfig.prefill_timeout_s),
                   help="seconds a prefill worker may take before the request is tried elsewhere")
    e = parser.add_argument_group("Turbine frontend: disaggregated encode (when encode workers exist: "
                                  "--multimodal-encode-worker)")
    e.add_argument("--image-embedding-transport", choices=EMBEDDING_TRANSPORTS,
                   default=env_str("TURBINE_IMAGE_EMBEDDING_TRANSPORT", DisaggConfig.image_embedding_transport),
                   help="how image embeddings travel from encode workers to the workers that take them: nixl "
                        "(the encode worker's memory, read over NIXL) or file (a file on the same host)")
    e.add_argument("--encode-timeout", type=float,
                   default=env_float("TURBINE_ENCODE_TIMEOUT", DisaggConfig.encode_timeout_s),
                   help="seconds an encode worker may take before the next is tried (none left: the workers "
                        "encode the images themselves)")
    st = parser.add_argument_group("Turbine frontend: stored responses and conversations (/v1/responses with "
                                   "store, previous_response_id, background; /v1/conversations)")
    st.add_argument("--response-store", choices=STORE_KINDS, default=env("TURBINE_RESPONSE_STORE", "auto"),
                    help="where they live: memory (this process), nats (a NATS JetStream key-value bucket every "
                         "frontend shares), off (stateless: store defaults to false, store: true is refused); "
                         "auto: memory for one process, off for --frontend-processes > 1 (default auto)")
    st.add_argument("--response-store-nats-url", default=env("TURBINE_RESPONSE_STORE_NATS_URL", StoreConfig.nats_url),
                    help="the NATS server (JetStream on: nats-server -js) of --response-store nats")
    st.add_argument("--response-store-bucket", default=env("TURBINE_RESPONSE_STORE_BUCKET", StoreConfig.bucket),
                    help="the JetStream key-value bucket of --response-store nats (made when missing)")
    st.add_argument("--response-store-ttl", type=float,
                    default=env_float("TURBINE_RESPONSE_STORE_TTL", StoreConfig.ttl_s),
                    help="seconds a stored response or conversation is kept (default 30 days, as OpenAI)")
    st.add_argument("--response-store-max-bytes", type=int,
                    default=env_int("TURBINE_RESPONSE_STORE_MAX_BYTES", StoreConfig.max_bytes),
                    help="bytes the store holds at most; past it the least recently used (memory) or oldest "
                         "(nats) go first (default 256 MiB)")
    st.add_argument("--response-store-max-entries", type=int,
                    default=env_int("TURBINE_RESPONSE_STORE_MAX_ENTRIES", StoreConfig.max_entries),
                    help="responses and conversations the memory store holds at most (default 10000)")
    st.add_argument("--response-store-max-record-bytes", type=int,
                    default=env_int("TURBINE_RESPONSE_STORE_MAX_RECORD_BYTES", StoreConfig.max_record_bytes),
                    help="largest stored response or conversation (nats: at most the server's max_payload); a "
                         "larger one is refused with 413 (default 1 MiB)")
    m = parser.add_argument_group("Turbine frontend: request migration (a request whose worker fails goes on "
                                  "on another)")
    m.add_argument("--migration-limit", type=int, default=env_int("TURBINE_MIGRATION_LIMIT", None),
                   help="times a request may move to another worker when its worker dies, disconnects, shuts "
                        "down or is overloaded (0: never; env TURBINE_MIGRATION_LIMIT); unset: each model's "
                        "workers' --migration-limit (default 0)")
    m.add_argument("--migration-max-seq-len", type=int, default=env_int("TURBINE_MIGRATION_MAX_SEQ_LEN", None),
                   help="requests whose prompt plus generated tokens exceed this are not migrated (default: no "
                        "bound; env TURBINE_MIGRATION_MAX_SEQ_LEN)")


def frontend_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FrontendConfig:
    router = router_config_from_args(args, parser)
    try:
        pools = tuple(parse_pool(value, args.discovery_ttl) for value in args.pool or ())
    except ValueError as exc:
        parser.error(f"{POOL_FLAG} {exc}")
    with config_errors_to(parser):
        return FrontendConfig(http_host=args.http_host, http_port=args.http_port, router=router,
                              namespace=args.namespace, api_key=args.api_key,
                              max_request_bytes=args.max_request_bytes,
                              max_prompt_embeds_bytes=args.max_prompt_embeds_bytes,
                              ignore_unknown_fields=args.ignore_unknown_fields,
                              max_inflight_requests=args.max_inflight_requests,
                              overload_retry_after=args.overload_retry_after,
                              busy=BusyConfig(requests=args.busy_threshold_requests,
                                              prompt_tokens=args.busy_threshold_prompt_tokens,
                                              queue_size=args.busy_queue_size),
                              processes=args.frontend_processes, access_log=args.access_log, pools=pools,
                              media=MediaConfig(max_image_bytes=args.max_image_bytes,
                                                max_image_pixels=args.max_image_pixels,
                                                max_images=args.max_images_per_request,
                                                fetch_timeout_s=args.media_fetch_timeout,
                                                max_redirects=args.media_max_redirects,
                                                allow_private_urls=args.allow_private_media_urls,
                                                frontend_decoding=args.frontend_decoding),
                              discovery=discovery_config_from_args(args, parser),
                              security=cluster_security_from_args(args, parser),
                              request_plane=request_plane_from_args(args, parser),
                              disagg=DisaggConfig(max_local_prefill_length=args.max_local_prefill_length,
                                                  prefill_timeout_s=args.prefill_timeout,
                                                  image_embedding_transport=args.image_embedding_transport,
                                                  encode_timeout_s=args.encode_timeout),
                              store=StoreConfig(kind=args.response_store, nats_url=args.response_store_nats_url,
                                                bucket=args.response_store_bucket, ttl_s=args.response_store_ttl,
                                                max_bytes=args.response_store_max_bytes,
                                                max_entries=args.response_store_max_entries,
                                                max_record_bytes=args.response_store_max_record_bytes),
                              migration=MigrationConfig(limit=args.migration_limit,
                                                        max_seq_len=args.migration_max_seq_len))


def build_parser(prog: str = "python -m turbine.frontend") -> argparse.ArgumentParser:
    with env_errors(prog):
        parser = argparse.ArgumentParser(prog=prog, description="Turbine OpenAI-compatible frontend.")
        add_config_arg(parser)
        add_frontend_args(parser)
        add_discovery_args(parser)
        add_cluster_security_args(parser, listens=False)  # its internal-plane side is client only
        add_request_plane_args(parser.add_argument_group("Turbine request plane"))
        add_logging_args(parser)
        add_tracing_args(parser)
    return parser


def parse_frontend_args(argv: list[str] | None = None) -> FrontendConfig:
    parser = build_parser()
    return frontend_config_from_args(parser.parse_args(with_config_file(parser, argv)), parser)

"""Worker command line: every vLLM engine flag (vLLM's own parser) plus Turbine's flags,
turned into one typed WorkerConfig."""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from dataclasses import dataclass

from turbine.config import check, flag
from turbine.flag_sources import add_config_arg, env_errors, env_forms, with_config_file
from turbine.logging_setup import add_logging_args
from turbine.protocol.encode import ENCODE_ENDPOINT, IMAGE_ENCODE
from turbine.vllm.compat import EC_CONSUMER_RELEASES, VLLM_VERSION, release_of
from turbine.vllm.connectors import (
    ConnectorError,
    KvbmTiers,
    check_kvbm_flags,
    kv_transfer_config,
    kvbm_runner_refusal,
    parse_connectors,
    uses_kvbm,
)
from turbine.vllm.engine_fork import ENGINE_CORE_STARTS
from turbine.vllm.sleep import platform_sleep_refusal
from turbine.worker.config import EMBEDDINGS, ServingConfig, add_serving_args, checked, serving_fields_from_args
from turbine.worker.kv_publisher import DEFAULT_REPLAY_BUFFER

# Dynamo's vLLM backend maps these load formats to worker classes of other NVIDIA packages; vLLM has no
# loader of these names, so without a refusal the flag would reach vLLM's loader and fail deep inside it.
LOAD_FORMATS_REFUSED = {
    "gms": "--load-format gms (GPU memory service: one process holds the weights in GPU memory and the engines "
           "map them, for fast restarts and failover) is not built in Turbine: it needs a GPU and NVIDIA's "
           "gpu_memory_service package, neither of which this build has or was tried with; load the weights "
           "with vLLM's own formats (auto, safetensors, ...)",
    "mx-source": "--load-format mx-source (ModelExpress peer-to-peer weight loading) is not built in Turbine; "
                 "use vLLM's own formats (auto, safetensors, ...)",
    "mx-target": "--load-format mx-target (ModelExpress peer-to-peer weight loading) is not built in Turbine; "
                 "use vLLM's own formats (auto, safetensors, ...)",
}

KV_EVENTS_CONFIG_REFUSED = (
    "--kv-events-config is not supported: Turbine relays the engine's KV events to its KV routers "
    "itself (over --event-plane), and a KV events config of your own would replace that relay and "
    "leave the routers blind; drop the flag")


# vLLM's own flags for disaggregated encoding: Turbine builds it its own way (issue #19), and these would be
# inert or break requests beside it, so they are refused by name.
MULTIMODAL_REFUSED = {
    "ec_transfer_config": "--ec-transfer-config is not supported: Turbine configures the engine's encoder-cache "
                          "connector itself (--take-image-embeddings; encode workers: --multimodal-encode-worker); "
                          "drop the flag",
    "mm_encoder_only": "--mm-encoder-only is not supported: an encode worker is --multimodal-encode-worker, "
                       "which runs the vision tower without an engine; drop the flag",
    "enable_mm_embeds": "--enable-mm-embeds is not supported: the frontend takes no image embeddings "
                        "(image_url parts only); drop the flag",
}
OMNI_ALONE = ("an omni worker runs its pipeline's stages as whole requests, in text mode: drop "
              "--disaggregation-mode, --multimodal-encode-worker, --headless, --enable-multimodal, "
              "--take-image-embeddings and --use-vllm-tokenizer")
ENCODE_WORKER_ALONE = ("an encode worker (--multimodal-encode-worker) serves only the encode endpoint: drop "
                       "--enable-multimodal, --take-image-embeddings, --disaggregation-mode, --connector, "
                       "--use-vllm-tokenizer and --runner pooling (one role per process)")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(ServingConfig):
    engine_args: object  # vllm AsyncEngineArgs (typed loosely so this module imports without vLLM)
    # Text mode: requests carry text that this worker renders and tokenizes with the engine's
    # tokenizer, and it returns text (for models whose tokenizer the frontend cannot load).
    use_vllm_tokenizer: bool = flag("--use-vllm-tokenizer", default=False)
    # Images in chats (GenerateRequest.images, which the frontend fetched and checked): the engine encodes
    # them in-process. Off, a request with images is refused (the security gate of issue #19).
    enable_multimodal: bool = flag("--enable-multimodal", default=False)
    # Disaggregated encode (issue #19). An encode worker runs only the vision tower and projector and serves
    # the `encode` endpoint (turbine/vllm/encode_worker.py); one role per process.
    multimodal_encode_worker: bool = flag("--multimodal-encode-worker", default=False)
    # A (prefill/decode or aggregated) worker whose engine loads the image embeddings an encode worker made
    # (GenerateRequest.image_embeddings) instead of running its own vision encoder for them.
    take_image_embeddings: bool = flag("--take-image-embeddings", default=False)
    # The encode worker's embedding cache (by image hash, LRU) and where its file transport writes.
    embedding_cache_mb: float = flag("--embedding-cache-mb", default=256.0)
    embedding_dir: str | None = flag("--embedding-dir", default=None)
    # The encode worker's compute threads (torch's intra-op threads). 1 by default: it shares the host's cores
    # with the engines, and OpenMP's spin-waiting over busy cores made the test model's vision tower 60x slower
    # with 2 threads than with 1 on the 2-core host (91 ms vs 1.5 ms a picture).
    encoder_threads: int = flag("--encoder-threads", default=1)
    # The first loopback port of the KV-event relay (rank r's engine publishes on it + r); None: any free run.
    kv_events_port: int | None = flag("--kv-events-port", default=None)
    # Publish the engine's KV cache events (with prefix caching on, on all but decode workers): the KV router's
    # view of this worker's cache. Off, a KV router sees nothing cached here (its --no-router-kv-events mode
    # learns from its own decisions instead) and the engine core builds and sends no events.
    kv_events: bool = flag("--no-kv-events", default=True)
    # A secondary node (turbine/vllm/headless.py): vLLM's engine processes of the ranks or workers the leader
    # fronts; it serves and registers nothing.
    headless: bool = flag("--headless", default=False)
    # A multi-stage vLLM-Omni pipeline (turbine/vllm/omni_worker.py) built from its stage-config file instead of
    # one engine; each flag needs the other.
    omni: bool = flag("--omni", default=False)
    stage_configs_path: str | None = flag("--stage-configs-path", default=None)
    # How vLLM's engine-core processes start on CPU (turbine/vllm/engine_fork.py): auto forks them from this worker
    # where the model runs in the engine core and leaves vLLM CPU's spawn elsewhere; fork forks them in every layout;
    # spawn is vLLM CPU's own way (torch and vLLM imported again). On a GPU vLLM decides: only auto there.
    engine_core_start: str = flag("--engine-core-start", default="auto")

    def __post_init__(self):
        super().__post_init__()
        check(self, self.engine_core_start in ENGINE_CORE_STARTS, "engine_core_start",
              f"must be one of {', '.join(ENGINE_CORE_STARTS)}, got {self.engine_core_start!r}")
        check(self, not self.omni or self.stage_configs_path is not None, "omni",
              "needs --stage-configs-path FILE (the pipeline's stages)")
        check(self, self.stage_configs_path is None or self.omni, "stage_configs_path",
              "is the omni worker's pipeline: add --omni or drop it")
        check(self, not self.omni or not (self.multimodal_encode_worker or self.headless or self.enable_multimodal
                                          or self.take_image_embeddings or self.use_vllm_tokenizer)
              and self.disaggregation_mode == "agg", "omni", OMNI_ALONE)
        if self.kv_events_port is not None:
            last = self.kv_events_port + self.data_parallel_size - 1
            check(self, 1024 <= self.kv_events_port and last <= 65535, "kv_events_port",
                  f"{self.kv_events_port}: must be between 1024 and {65535 - self.data_parallel_size + 1} (the relay "
                  f"takes {self.data_parallel_size} port(s) from it, one per data-parallel rank)")
            check(self, self.relays_kv_events and not self.multimodal_encode_worker, "kv_events_port",
                  "this worker relays no KV events (a decode or encode worker, prefix caching off, or "
                  "--no-kv-events): drop it")
        check(self, self.kv_events or self.kv_events_buffer == DEFAULT_REPLAY_BUFFER, "kv_events_buffer",
              "is the replay buffer of the KV events, and --no-kv-events publishes none: drop one of them")
        if self.multimodal_encode_worker:
            check(self, not (self.enable_multimodal or self.take_image_embeddings or self.use_vllm_tokenizer)
                  and self.disaggregation_mode == "agg" and getattr(self.engine_args, "runner", None) != "pooling"
                  and getattr(self.engine_args, "kv_transfer_config", None) is None,
                  "multimodal_encode_worker", ENCODE_WORKER_ALONE)
        for name, default in (("embedding_cache_mb", 256.0), ("embedding_dir", None), ("encoder_threads", 1)):
            check(self, self.multimodal_encode_worker or getattr(self, name) == default, name,
                  "is an encode worker's setting: add --multimodal-encode-worker or drop it")
        check(self, self.embedding_cache_mb > 0, "embedding_cache_mb", "must be > 0")
        check(self, self.encoder_threads >= 1, "encoder_threads", "must be >= 1")
        check(self, self.embedding_dir is None or os.path.isdir(self.embedding_dir), "embedding_dir",
              f"{self.embedding_dir!r}: no such directory")
        check(self, not self.take_image_embeddings or self.enable_multimodal, "take_image_embeddings",
              "needs --enable-multimodal (the worker takes images; their embeddings come from encode workers)")
        check(self, not self.use_vllm_tokenizer or self.disaggregation_mode == "agg", "use_vllm_tokenizer",
              "text mode (--use-vllm-tokenizer) serves whole requests only: drop --disaggregation-mode")
        check(self, getattr(self.engine_args, "kv_events_config", None) is None, "engine_args",
              KV_EVENTS_CONFIG_REFUSED)
        check(self, not self.enable_multimodal or (not self.use_vllm_tokenizer
                                                  and getattr(self.engine_args, "runner", None) != "pooling"),
              "enable_multimodal", "images are served in token mode by generating workers only: drop "
              "--use-vllm-tokenizer and --runner pooling")
        for name, why in MULTIMODAL_REFUSED.items():
            value = getattr(self.engine_args, name, None)
            check(self, value is None or value is False, "engine_args", why)
        pooling = getattr(self.engine_args, "runner", None) == "pooling"
        check(self, pooling == (EMBEDDINGS in self.endpoint_types), "endpoint_types",
              "a pooling worker (--runner pooling) serves embeddings only, and only it does")
        check(self, not pooling or self.disaggregation_mode == "agg", "disaggregation_mode",
              "a pooling worker (--runner pooling) is not disaggregated")

    @property
    def relays_kv_events(self) -> bool:
        """The engine publishes KV events and the worker relays them: prefix caching on, not a decode worker
        (routing picks prefill workers by their caches), and not --no-kv-events."""
        return bool(getattr(self.engine_args, "enable_prefix_caching", True)) and not self.is_decode and self.kv_events

    @property
    def data_parallel_size(self) -> int:
        return getattr(self.engine_args, "data_parallel_size", None) or 1

    @property
    def remote_ranks(self) -> bool:
        """Some of the data-parallel ranks this worker fronts run on other (--headless) nodes."""
        local = getattr(self.engine_args, "data_parallel_size_local", None)
        return local is not None and local < self.data_parallel_size

    @property
    def data_parallel_address(self) -> str:
        return getattr(self.engine_args, "data_parallel_address", None) or "127.0.0.1"


def build_parser():
    with env_errors("python -m turbine.vllm"):
        return _build_parser()


def _build_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m turbine.vllm",
                                    description="Turbine vLLM worker: token-in/token-out generation.")
    # Turbine reads --config itself (vLLM's parser would too, but it drops a `false` switch that has no
    # --no- form and raises instead of naming a bad file), for the same precedence as every process.
    add_config_arg(parser)
    # vLLM's own parser defines --reasoning-parser (read as Turbine's --dyn-reasoning-parser).
    add_serving_args(parser, reasoning_parser_alias=False)
    parser.add_argument("--connector", nargs="+", default=None,
                        help="KV connector(s): nixl, lmcache, kvbm (KV tiers, see --kv-*-cache-*) or none; several "
                             "(space- or comma-separated) become vLLM's MultiConnector in that order. Required with "
                             "--disaggregation-mode prefill|decode unless --kv-transfer-config is given; kvbm "
                             "goes on aggregated workers alone and on prefill workers with nixl (kvbm nixl)")
    parser.add_argument("--enable-multimodal", action="store_true",
                        help="take images in chats (image_url parts, fetched and checked by the frontend) for a "
                             "vision-language model, which the engine encodes in-process; without it a request "
                             "with an image gets HTTP 400")
    parser.add_argument("--multimodal-encode-worker", action="store_true",
                        help="run as an encode worker: only the model's vision tower and projector, serving image "
                             "embeddings to the workers that take them (--take-image-embeddings); no engine, no "
                             "generate endpoint")
    parser.add_argument("--take-image-embeddings", action="store_true",
                        help="with --enable-multimodal: the engine loads image embeddings that encode workers made "
                             "(over NIXL or a local file) instead of running its vision encoder for those images")
    parser.add_argument("--embedding-cache-mb", type=float, default=256.0,
                        help="--multimodal-encode-worker: embeddings kept by image hash (LRU), in MiB; a cached "
                             "image skips the encoder")
    parser.add_argument("--embedding-dir", default=None,
                        help="--multimodal-encode-worker: where the file transport writes embeddings (default: a "
                             "private temporary directory; it must be on the consumers' host)")
    parser.add_argument("--encoder-threads", type=int, default=1,
                        help="--multimodal-encode-worker: compute threads of the vision tower (default 1: it shares "
                             "the host's cores with the engines)")
    parser.add_argument("--kv-host-cache-gb", type=float, default=None,
                        help="--connector kvbm: host-memory tier for KV blocks offloaded from the engine, in GiB")
    parser.add_argument("--kv-disk-cache-gb", type=float, default=None,
                        help="--connector kvbm: local-disk tier size in GiB (with --kv-disk-cache-dir)")
    parser.add_argument("--kv-disk-cache-dir", default=None,
                        help="--connector kvbm: directory of the disk tier (this worker's alone; block files "
                             "are checksummed, see turbine/kvbm/block.py)")
    parser.add_argument("--kv-disk-min-uses", type=int, default=None,
                        help="--connector kvbm: write a block to the disk tier only once it has been used this many "
                             "times (computed, or hit in a tier); default 1, every block (see docs/benchmarks/kv_tiers.md)")
    parser.add_argument("--kv-shared-cache-gb", type=float, default=None,
                        help="--connector kvbm: shared tier size in GiB (with --kv-shared-cache-dir): what all the "
                             "workers that share the directory keep there together")
    parser.add_argument("--kv-shared-cache-dir", default=None,
                        help="--connector kvbm: directory of the shared tier, which several workers (of one host, or "
                             "of hosts on a shared filesystem) read and write: a prefix one worker computed is "
                             "loaded by the others. Written by atomic rename, read checksummed")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="first port the relay of the engine's KV events binds (data-parallel rank r's engine "
                             "publishes on it + r; 1024-65535; loopback, or --data-parallel-address when ranks run "
                             "on other nodes); default: any free run. A leader with ranks on --headless nodes, and "
                             "those nodes, need the same fixed port")
    parser.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                        help="publish none of the engine's KV cache events (on by default with prefix caching, but on "
                             "decode workers): a KV router then sees nothing cached here, so use it with the "
                             "round-robin or random router, or the KV router's --no-router-kv-events")
    parser.add_argument("--headless", action="store_true",
                        help="a secondary node of a multi-node deployment: vLLM's engine processes only (the data-"
                             "parallel ranks --data-parallel-start-rank.. that the leader fronts, or the workers of "
                             "--node-rank > 0 for tensor/pipeline parallelism across nodes); no request plane, no "
                             "registration, a status server (/health, /live) when --system-port is given")
    parser.add_argument("--omni", action="store_true",
                        help="serve a multi-stage vLLM-Omni pipeline (e.g. text->text, text->image) built from "
                             "--stage-configs-path instead of one engine: chat text from the messages, text answers "
                             "streamed, images as PNGs (chat content parts, /v1/images/generations). Needs the "
                             "vllm-omni release of this vLLM and a GPU: refused with the reason otherwise")
    parser.add_argument("--stage-configs-path", default=None,
                        help="--omni: the pipeline's stage-config YAML (vLLM-Omni's format: a `stage_args` list, "
                             "or a deploy config's `stages` list); read and checked at start")
    parser.add_argument("--engine-core-start", choices=ENGINE_CORE_STARTS, default="auto",
                        help="on CPU, how vLLM's engine-core processes start. auto: forked from this worker where the "
                             "model runs in the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, one rank), which starts "
                             "it in about two thirds of the time and kills it with the worker, else spawned as vLLM CPU "
                             "does (torch and vLLM imported again); fork: forked in every layout (vLLM CPU's default "
                             "one, data parallelism), and the model runners forked from their engine core with the "
                             "threads and cores vLLM gives them: ready in about half the time there; spawn: vLLM "
                             "CPU's own way everywhere. On a GPU vLLM decides, and only auto is taken")
    parser.add_argument("--use-vllm-tokenizer", action="store_true",
                        help="text mode: the frontend sends text (chat messages or the prompt) and gets text back; "
                             "this worker applies vLLM's chat template, tokenizes and detokenizes (for models whose "
                             "tokenizer the frontend cannot load). KV-aware routing falls back to load only")
    parser.add_argument("--json-whitespace", choices=JSON_WHITESPACE, default="compact",
                        help="whitespace in structured JSON outputs (forced tool calls, response_format json_schema / "
                             "json_object, guided_json): compact (none between tokens: a small model cannot run away "
                             "in newlines until max_tokens; measured in benchmarks/frontend/json_whitespace.py) or any (JSON's "
                             "free whitespace, vLLM's default). Engine-wide: vLLM's grammar backends read it from the "
                             "engine's config, not per request (env TURBINE_JSON_WHITESPACE; default compact)")
    # Every flag Turbine adds has its environment variable by the naming rule (TURBINE_<FLAG>); vLLM's own
    # engine flags, added next, are vLLM's.
    env_forms(list(parser._actions))
    turbine_actions = list(parser._actions)
    parser = AsyncEngineArgs.add_cli_args(parser)
    parser.turbine_actions = turbine_actions  # the flags a --headless node must leave alone (multi_node_refusal)
    # vLLM's parser has --log-level and --otlp-traces-endpoint: they serve Turbine too.
    add_logging_args(parser, level=False)
    # No --model means the embedded default model (prepared on first use).
    parser.set_defaults(model=None)
    return parser


def parse_worker_args(argv: list[str] | None = None) -> WorkerConfig:
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = build_parser()
    args = parser.parse_args(with_config_file(parser, argv))

    served = args.served_model_name
    if isinstance(served, list):
        if len(served) > 1:
            parser.error("--served-model-name: Turbine workers serve exactly one name")
        served = served[0] if served else None
    fields = serving_fields_from_args(args, parser, served)
    if args.runner == "pooling":  # it serves /v1/embeddings (its card says so), not chat or completions
        fields["endpoint_types"] = (EMBEDDINGS,)
    if args.multimodal_encode_worker:  # it serves the encode endpoint only
        fields["endpoint_types"] = (IMAGE_ENCODE,)
        fields["endpoint"] = ENCODE_ENDPOINT
    serving = checked(ServingConfig, parser, **fields)
    _check_omni(args, parser)
    # --reasoning-parser is the frontend's reasoning parser only; the engine does not get it. With
    # one, vLLM enforces a structured-output constraint only after the reasoning ends (`</think>`),
    # so a forced tool call's schema or a guided regex would no longer cover the whole output.
    args.reasoning_parser = ""
    if args.reasoning_parser_plugin:
        parser.error("--reasoning-parser-plugin is not supported: the frontend parses reasoning with its own "
                     "parsers (--dyn-reasoning-parser); drop the flag")
    # The engine loads what --model resolved to, under the one served name.
    args.model = serving.model_path
    args.served_model_name = serving.served_model_name
    # Prefix caching is on unless the user turned it off explicitly.
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = True

    if args.take_image_embeddings and release_of(VLLM_VERSION) not in EC_CONSUMER_RELEASES:
        parser.error(f"--take-image-embeddings: checked with vLLM {', '.join(EC_CONSUMER_RELEASES)} only (its "
                     f"encoder-cache connector interface); this is vLLM {VLLM_VERSION}")
    if serving.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    if (refusal := LOAD_FORMATS_REFUSED.get(str(args.load_format))) is not None:
        parser.error(refusal)
    if (refusal := multi_node_refusal(args, parser.turbine_actions, decode=serving.is_decode)) is not None:
        parser.error(refusal)
    _configure_connector(args, parser, serving)
    if args.enable_sleep_mode and (reason := platform_sleep_refusal()):
        parser.error(f"--enable-sleep-mode: {reason}")
    if args.dtype == "auto":
        args.dtype = cpu_dtype_default() or "auto"

    _configure_json_whitespace(args, parser)
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(f"invalid vLLM engine arguments: {exc}")
    # Turbine detokenizes in the frontend; the engine still needs its tokenizer for EOS.
    engine_args.skip_tokenizer_init = False
    engine_args.disable_log_stats = False

    return checked(WorkerConfig, parser, **vars(serving), engine_args=engine_args,
                   use_vllm_tokenizer=args.use_vllm_tokenizer, enable_multimodal=args.enable_multimodal,
                   multimodal_encode_worker=args.multimodal_encode_worker,
                   take_image_embeddings=args.take_image_embeddings, embedding_cache_mb=args.embedding_cache_mb,
                   embedding_dir=args.embedding_dir, encoder_threads=args.encoder_threads,
                   kv_events_port=args.kv_events_port, kv_events=args.kv_events, headless=args.headless,
                   omni=args.omni,
                   stage_configs_path=args.stage_configs_path, engine_core_start=args.engine_core_start)


def _check_omni(args, parser) -> None:
    """--omni and --stage-configs-path: refused before any engine is built where they cannot run (the reason
    named: turbine.vllm.omni_config.omni_flags_refusal)."""
    from turbine.vllm.omni_config import omni_flags_refusal

    if (refusal := omni_flags_refusal(args.omni, args.stage_configs_path)) is not None:
        parser.error(refusal)


JSON_WHITESPACE = ("compact", "any")

# What a --headless node reads of Turbine's own flags: where its status server listens, the port of the
# leader's KV-event relay its ranks publish to, the discovery it finds the leader's card in, and the mode
# itself (logging and --config are read before).
HEADLESS_FLAGS = {"headless", "system_host", "system_port", "kv_events_port", "kv_events", "config", "help",
                  "engine_core_start",
                  # where the leader's card is (a headless node watches it: turbine/vllm/headless.py)
                  "discovery_backend", "discovery_dir", "etcd_endpoints", "discovery_ttl"}


def multi_node_refusal(args, turbine_actions, decode: bool = False) -> str | None:
    """Why this multi-node setting cannot run (None: it can). A worker (the leader) fronts data-parallel ranks
    from 0; ranks and tensor/pipeline workers of other nodes run there with --headless (vLLM's own engine
    processes only). vLLM's per-node API servers (hybrid or external load balancing) are not Turbine's."""
    for name in ("data_parallel_hybrid_lb", "data_parallel_external_lb"):
        if getattr(args, name, False):
            flag = "--" + name.replace("_", "-")
            return (f"{flag} is not supported: one worker (the leader) fronts every data-parallel rank, and the "
                    f"ranks of other nodes run there with --headless; drop the flag")
    size = args.data_parallel_size or 1
    local = args.data_parallel_size_local
    start = args.data_parallel_start_rank or 0
    nnodes, node_rank = getattr(args, "nnodes", 1) or 1, getattr(args, "node_rank", 0) or 0
    if start and not 0 < start < size:
        return f"--data-parallel-start-rank {start}: the ranks are 0..{size - 1} (--data-parallel-size {size})"
    if local is not None and start + local > size:
        return (f"--data-parallel-size-local {local} from rank {start}: ranks up to {start + local - 1}, beyond "
                f"--data-parallel-size {size}")
    if not 0 <= node_rank < nnodes:
        return f"--node-rank {node_rank}: the nodes are 0..{nnodes - 1} (--nnodes {nnodes})"
    # WorkerConfig.relays_kv_events, read from the parsed flags (the config is not built yet)
    relays = args.enable_prefix_caching is not False and not decode and args.kv_events
    if not args.headless:
        if start:
            return (f"--data-parallel-start-rank {start}: a worker fronts the ranks from 0; the ranks of another "
                    "node run there with --headless")
        if node_rank:
            return (f"--node-rank {node_rank}: that node runs no engine front of its own; start it with "
                    "--headless (the leader is --node-rank 0)")
        if local is not None and local < size and relays and args.kv_events_port is None:
            return ("--kv-events-port: ranks of this worker run on other nodes (--data-parallel-size-local "
                    f"{local} of {size}); their KV events reach its relay on a port they must know: give the "
                    "same --kv-events-port here and to the --headless nodes")
        return None
    dp_secondary = size > 1 and start > 0 and (local or 0) >= 1
    if not (dp_secondary or node_rank > 0):
        return ("--headless runs the engine processes of another node than the leader: give "
                "--data-parallel-start-rank > 0 with --data-parallel-size-local (data-parallel ranks), or "
                "--nnodes with --node-rank > 0 (tensor/pipeline parallelism across nodes)")
    for action in turbine_actions:
        if action.dest in HEADLESS_FLAGS or getattr(args, action.dest, action.default) == action.default:
            continue
        flag = max(action.option_strings, key=len)
        return (f"{flag}: a --headless node serves and registers nothing (its engine processes join the "
                f"leader's), so {flag} does nothing there; give it to the leader and drop it here")
    if dp_secondary and relays and args.kv_events_port is None:
        return ("--kv-events-port: this node's ranks publish their KV events to the leader's relay; give the "
                "leader's --kv-events-port (and its --data-parallel-address), or --no-kv-events as the leader has")
    return None


def _configure_json_whitespace(args, parser) -> None:
    """--json-whitespace compact: the engine's structured-outputs config disables JSON's free
    whitespace (xgrammar: no whitespace, compact separators; guidance: whitespace_flexible off).
    vLLM takes this only with a named backend: `auto` (the default) becomes xgrammar, so a schema
    that xgrammar cannot compile is a 400 naming the request's field rather than a fallback to
    guidance (--json-whitespace any, or --structured-outputs-config with backend guidance, keeps it)."""
    config = args.structured_outputs_config
    if args.json_whitespace == "any" or config.disable_any_whitespace:
        return
    backend = "xgrammar" if config.backend == "auto" else config.backend
    if backend not in ("xgrammar", "guidance"):
        parser.error(f"--json-whitespace compact: the structured-outputs backend {config.backend!r} cannot make "
                     "JSON compact; use --json-whitespace any, or backend xgrammar or guidance")
    args.structured_outputs_config = dataclasses.replace(config, backend=backend, disable_any_whitespace=True)


def cpu_dtype_default(cpuinfo: str | None = None) -> str | None:
    """float32 on an x86 CPU engine without native bfloat16 (AVX512-BF16 or AMX), else None
    (vLLM's choice). vLLM picks bfloat16 on every CPU; emulated on AVX2 it made prefill about
    6x slower than float32 (SmolLM2-135M on an AVX2-only AMD EPYC: 1000 prompt tokens in
    27 s vs 5 s), while decode steps took the same time."""
    if cpuinfo is None:
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu" or platform.machine() not in ("x86_64", "AMD64"):
            return None
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None or {"avx512_bf16", "amx_bf16"} & set(flags):
        return None
    logging.getLogger("turbine.vllm").info("this CPU has no native bfloat16 (AVX512-BF16/AMX): --dtype float32 "
                                           "(give --dtype to choose)")
    return "float32"


def _configure_connector(args, parser, serving: ServingConfig) -> None:
    """--connector (or vLLM's own --kv-transfer-config) → args.kv_transfer_config."""
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    explicit = args.kv_transfer_config is not None
    if explicit and args.connector is not None:
        parser.error("--connector and --kv-transfer-config both configure the KV connector: give one")
    tiers = KvbmTiers(args.kv_host_cache_gb, args.kv_disk_cache_gb, args.kv_disk_cache_dir, args.kv_disk_min_uses,
                      args.kv_shared_cache_gb, args.kv_shared_cache_dir)
    if explicit:
        try:
            check_kvbm_flags([], tiers)
        except ConnectorError as exc:
            parser.error(str(exc))
    if not explicit:
        try:
            names = parse_connectors(" ".join(args.connector) if isinstance(args.connector, list) else args.connector)
            fields = kv_transfer_config(names, buffer_device=current_platform.device_type,
                                        decode=serving.is_decode, tiers=tiers)
        except ConnectorError as exc:
            parser.error(str(exc))
        args.kv_transfer_config = KVTransferConfig(**fields) if fields else None
        mode = serving.disaggregation_mode
        if "kvbm" in names and mode == "decode":
            # vLLM's MultiConnector gives a request to one connector: a tier hit would replace NIXL's pull
            # of the rest of the prompt by computing it here (see turbine.vllm.connectors).
            parser.error("--connector kvbm is not for decode workers: a decode worker takes its prompt's KV over "
                         "nixl (--connector nixl); put the tiers on the prefill worker (--connector kvbm nixl)")
        if "kvbm" in names and mode == "prefill" and "nixl" not in names:
            parser.error("--connector kvbm does not move KV to the decode worker: a prefill worker needs nixl too "
                         "(--connector kvbm nixl)")
        if "kvbm" in names and "nixl" in names and mode == "agg":
            parser.error("--connector kvbm with nixl is for prefill workers (--disaggregation-mode prefill); an "
                         "aggregated worker takes --connector kvbm alone")
        if "kvbm" in names and any((getattr(args, a, None) or 1) > 1 for a in (
                "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")):
            # Its scheduler and model-runner halves share one store: one engine process per worker.
            parser.error("--connector kvbm: not with --tensor-parallel-size, --pipeline-parallel-size or "
                         "--data-parallel-size above 1 yet")
    if serving.disaggregation_mode != "agg" and args.kv_transfer_config is None:
        parser.error(f"a {serving.disaggregation_mode} worker moves KV to or from its peers: add --connector nixl "
                     "(or --kv-transfer-config JSON)")
    if uses_kvbm(args.kv_transfer_config) and (refusal := kvbm_runner_refusal()) is not None:
        parser.error(refusal)

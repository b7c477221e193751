"""The vLLM worker process: the worker host (turbine/worker/host.py) around one vLLM engine
(AsyncLLM, one or more data-parallel ranks), its request-plane endpoints, its KV-event relay
and its load reports. vLLM itself is imported here and in the modules below, never by the
mocker."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import replace

from vllm.v1.engine.async_llm import AsyncLLM

from turbine.logging_setup import setup_logging
from turbine.model.prepare import tokenizer_folder
from turbine.protocol.embed import EMBED_ENDPOINT, EmbedRequest
from turbine.protocol.generate import ClearKvBlocksRequest, GenerateRequest
from turbine.runtime.event_plane import WorkerEventPlane
from turbine.runtime.registration import CLEAR_KV_BLOCKS, advertised_host
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.status_server import Health
from turbine.tracing import setup_tracing
from turbine.worker.worker_metrics import WorkerMetrics
from turbine.vllm import amx
from turbine.vllm.args import WorkerConfig, parse_worker_args
from turbine.vllm.canary import generate_canary, pooling_canary
from turbine.vllm.compat import engine_env_defaults, ping_engine_rank, unfinished_requests, unknown_release_warning
from turbine.vllm.embed import EmbedHandlers
from turbine.vllm.engine_fork import engine_cores_forked
from turbine.vllm.images import measured_placeholder
from turbine.vllm.connectors import claim_nixl_side_channel, keep_model_runner_v1, uses_kvbm, uses_nixl
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.vllm.headless import node_group
from turbine.vllm.kv_events_relay import VllmKvEventsRelay
from turbine.vllm.kvbm_connector import kv_shared_tier
from turbine.vllm.lora import VllmLora
from turbine.vllm.load_metrics import StatTargets, stat_logger_factory
from turbine.vllm.sleep import VllmSleep, platform_sleep_refusal, sleep_engine, wake_engine
from turbine.worker.config import EMBEDDINGS
from turbine.worker.events import InstanceEvents
from turbine.worker.host import Instance, WorkerHost, run_host
from turbine.worker.snapshot import RestoredIdentity

log = logging.getLogger("turbine.vllm")

ENGINE_CHECK_INTERVAL_S = 2.0
REMOTE_RANK_PING_S = 4.0
# An engine answers a ping between two steps; a step this long (a huge prefill on a slow CPU) would be taken for
# a dead node.
REMOTE_RANK_TIMEOUT_S = 20.0


class VllmEngine:
    """vLLM as an engine kind for the worker host: one instance. The engine is built first (build():
    no socket of Turbine's is opened before it; the KV-event relay's ports are chosen before and bound
    after, closed by checkpoint mode while quiesced and bound again after the restore); the instance, its
    metrics and its event publishers are made by start(), under the identity it serves as."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.metrics: WorkerMetrics | None = None  # start(): its labels carry the identity a restore may change
        self.engine: AsyncLLM | None = None
        self.events: InstanceEvents | None = None
        self.relay: VllmKvEventsRelay | None = None
        self._stats = StatTargets(pulls_kv=cfg.is_decode)  # where the engine's stat loggers report, set by start()
        self._load_seconds = 0.0
        self._quiesced: str | None = None  # how quiesce() stilled the engine: "sleep" or "pause"
        self._amx_after_restore = False  # build(): a restore must give the engine's processes AMX again (amx.py)
        self._relay_task: asyncio.Task | None = None
        self._server: RequestPlaneServer | None = None
        self.pooling = False
        self._handlers = None  # the role's generate handlers, or the pooling worker's embed handlers (the canary)

    async def build(self, *, checkpoint: bool) -> None:
        cfg = self.cfg
        ranks = cfg.data_parallel_size
        if uses_nixl(cfg.engine_args.kv_transfer_config):  # exported for the engine, read when it is built
            port = claim_nixl_side_channel(advertised_host(cfg.host), ranks)
            log.info("NIXL side channel on port %d", port)
        if uses_kvbm(cfg.engine_args.kv_transfer_config):
            keep_model_runner_v1()  # its failed loads are rewound right by V1 only (turbine.vllm.connectors)
        # With prefix caching on, the engine's KV events are relayed for KV routers (decode workers relay none:
        # routing picks prefill workers by their caches). The relay's ports are chosen before the engine is built,
        # as its publisher connects to them; its publishers are attached by start().
        if cfg.relays_kv_events:
            # Ranks on other nodes publish to the relay over the data-parallel network (the one vLLM's own engine
            # handshake and outputs cross), so it listens there; otherwise on loopback.
            host = cfg.data_parallel_address if cfg.remote_ranks else "127.0.0.1"
            self.relay = VllmKvEventsRelay(port=cfg.kv_events_port, host=host, ranks=ranks)
            cfg.engine_args.kv_events_config = self.relay.engine_config()
        if cfg.take_image_embeddings:
            # The engine's encoder-cache connector loads the embeddings encode workers made (ec_connector.py).
            from vllm.config import ECTransferConfig

            from turbine.vllm.ec_connector import engine_config

            cfg.engine_args.ec_transfer_config = ECTransferConfig(**engine_config())
        if checkpoint and amx.needed_after_restore():
            cfg.engine_args.worker_extension_cls = amx.EXTENSION  # checkpoint_refusal(): not the user's own
            self._amx_after_restore = True
        building = time.monotonic()
        # vLLM's stat-logger hook feeds the load reports and the worker's KV gauges of each rank.
        with engine_cores_forked(cfg.engine_args, cfg.engine_core_start):
            self.engine = AsyncLLM.from_engine_args(cfg.engine_args, stat_loggers=[stat_logger_factory(self._stats)])
        self._load_seconds = time.monotonic() - building
        if self.relay is not None:  # listens only now: an engine core forked before would hold its socket open
            await self.relay.listen()

    def checkpoint_refusal(self) -> str | None:
        cfg = self.cfg
        transfer = cfg.engine_args.kv_transfer_config
        reason = None
        if cfg.remote_ranks:
            reason = "its data-parallel ranks on other nodes (--headless) are processes no checkpoint of this one holds"
        elif uses_nixl(transfer) or uses_kvbm(transfer) or transfer is not None:
            reason = "a KV connector (--connector / --kv-transfer-config) holds transfer state and sockets of its own"
        elif cfg.take_image_embeddings:
            reason = "--take-image-embeddings: its encoder-cache connector reads a shared store not checkpointed"
        elif amx.needed_after_restore() and cfg.engine_args.worker_extension_cls not in ("", amx.EXTENSION):
            reason = ("on a CPU with AMX a restored engine must ask for AMX's tile state again, through Turbine's own "
                      "vLLM worker extension: --worker-extension-cls is taken")
        elif platform_sleep_refusal() is None and not cfg.engine_args.enable_sleep_mode:
            # On a GPU the engine is quiesced by a level-1 sleep (its KV cache freed before the dump).
            reason = "on a GPU it is quiesced by a level-1 sleep: start it with --enable-sleep-mode"
        return None if reason is None else f"the vLLM worker cannot be checkpointed: {reason}"

    async def quiesce(self) -> None:
        """Nothing runs and nothing is cached in the image: on a GPU a level-1 sleep (KV cache freed,
        weights offloaded); on CPU, which has no sleep mode, the scheduler is paused, drained and the
        prefix and encoder caches reset (the image then holds an empty cache: a restored worker
        announces none, and routers have nothing of it to forget)."""
        engine = self.engine
        if platform_sleep_refusal() is None:
            await sleep_engine(engine, 1)
            self._quiesced = "sleep"
        else:
            await engine.pause_generation()  # (defaults: abort what runs, clear the cache; none runs yet)
            self._quiesced = "pause"
            while unfinished_requests(engine):
                await asyncio.sleep(0.05)
            if not await engine.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset after draining the engine")
            await engine.reset_encoder_cache()
        if self.relay is not None:
            self.relay.unbind()

    async def resume(self) -> None:
        if self._quiesced == "sleep":
            await wake_engine(self.engine)
        elif self._quiesced == "pause":
            if self._amx_after_restore:  # before any step: a tile instruction without it is a SIGILL (amx.py)
                granted = [amx.request_tiles(), *await self.engine.collective_rpc(amx.RPC)]
                log.info("restored on a CPU with AMX: tile state granted again in %d of %d processes",
                         sum(granted), len(granted))
            await self.engine.resume_generation()
        self._quiesced = None
        if self.relay is not None and not await self.relay.listen():
            log.warning("the engine's KV-event publisher did not reconnect to the relay within 5 s of the restore; "
                        "events it publishes before it does are lost")

    def restore_identity(self, identity: RestoredIdentity) -> None:
        changes = {k: v for k, v in (("namespace", identity.namespace), ("component", identity.component)) if v}
        if changes:
            self.cfg = replace(self.cfg, **changes)
        if identity.instance_id:
            self.instance_id = identity.instance_id

    async def start(self, plane: WorkerEventPlane, health: Health) -> list[Instance]:
        cfg, engine = self.cfg, self.engine
        ranks = cfg.data_parallel_size
        self.metrics = WorkerMetrics({"namespace": cfg.namespace, "component": cfg.component,
                                      "model": cfg.served_model_name, "worker_id": self.instance_id},
                                     data_parallel_size=ranks)
        self.metrics.model_load_seconds.set(self._load_seconds)
        # Load reports go out whatever the role or prefix caching. Decode workers relay no KV events but keep
        # empty publishers, so routers follow their address for their load and get an empty cache on replay.
        self.events = InstanceEvents(plane, self.instance_id, data_parallel_size=ranks,
                                     kv_events=self.relay is not None or cfg.is_decode,
                                     kv_events_buffer=cfg.kv_events_buffer)
        if self.relay is not None:
            self.relay.attach(self.events.kv)
            self._relay_task = asyncio.create_task(self.relay.run())
        self._stats.rank_gauges = self.metrics.ranks
        self._stats.publisher = self.events.load
        vcfg = engine.vllm_config
        self.metrics.set_total_kv_blocks(vcfg.cache_config.num_gpu_blocks or 0)
        loras = VllmLora(engine, cfg.model_path, cfg.served_model_name)
        handlers = HANDLERS_OF_ROLE[cfg.disaggregation_mode](
            engine, self.metrics, on_cleared=self.relay.cleared if self.relay else None,
            kv_transfer_timeout=cfg.kv_transfer_timeout, on_success=health.succeeded,
            data_parallel_size=vcfg.parallel_config.data_parallel_size, text_mode=cfg.use_vllm_tokenizer,
            chat_template=_read(cfg.custom_jinja_template) if cfg.use_vllm_tokenizer else None,
            admission=cfg.admission(self.metrics), loras=loras, multimodal=cfg.enable_multimodal,
            take_image_embeddings=cfg.take_image_embeddings)

        if cfg.enable_multimodal and not vcfg.model_config.is_multimodal_model:
            raise RuntimeError(f"--enable-multimodal: the model {cfg.model_path!r} is not a vision-language model "
                               "(vLLM serves it as text only); drop the flag")
        image_token = image_token_id(vcfg.model_config.hf_config) if cfg.enable_multimodal else None
        # What the engine widens an image token to (None: depends on the picture): the frontend hashes image
        # prompts as the engine holds them (as the KV events give them) and checks max_tokens against them.
        placeholder = None if image_token is None else measured_placeholder(engine.renderer, image_token)
        handlers.image_placeholder = placeholder
        server = cfg.request_plane_config.server(cfg.host, cfg.port)
        # A pooling model (--runner pooling, or a model that is one) embeds and does not generate.
        self.pooling = vcfg.model_config.runner_type == "pooling"
        if self.pooling:
            embed = self._handlers = EmbedHandlers(engine, self.metrics, on_success=health.succeeded)
            server.register(EMBED_ENDPOINT, EmbedRequest, embed.embed)
        else:
            self._handlers = handlers
            server.register(cfg.endpoint, GenerateRequest, handlers.generate)
        server.register(CLEAR_KV_BLOCKS, ClearKvBlocksRequest, handlers.clear_kv_blocks)
        self.events.serve_replay(server)
        self._server = server
        sched = vcfg.scheduler_config
        card = cfg.model_card(
            self.instance_id, engine="vllm", tokenizer_path=tokenizer_folder(cfg.model_path),
            context_length=vcfg.model_config.max_model_len, kv_block_size=vcfg.cache_config.block_size,
            total_kv_blocks=vcfg.cache_config.num_gpu_blocks or 0, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            data_parallel_size=vcfg.parallel_config.data_parallel_size,
            model_input="text" if cfg.use_vllm_tokenizer else "tokens",
            accepts_prompt_embeds=vcfg.model_config.enable_prompt_embeds and not self.pooling,
            multimodal=cfg.enable_multimodal,
            image_token_id=image_token, image_placeholder=placeholder,
            takes_image_embeddings=cfg.take_image_embeddings,
            endpoint_types=[EMBEDDINGS] if self.pooling else None, kv_shared_tier=kv_shared_tier(vcfg),
            node_group=node_group(vcfg.parallel_config, cfg.remote_ranks),
            **self.events.card_fields())
        total_blocks = vcfg.cache_config.num_gpu_blocks or 0
        sleep = VllmSleep(engine, on_change=lambda level: self.metrics.set_total_kv_blocks(0 if level else total_blocks),
                          on_reload=self.metrics.model_load_seconds.set)
        return [Instance(server, card, sleep=sleep, lora=None if self.pooling else loras, metrics=self.metrics)]

    async def canary(self) -> str | None:
        payload = self.cfg.health_check_payload
        if self.pooling:
            return await pooling_canary(self._handlers, self.engine, payload)
        return await generate_canary(self._handlers, self.engine, payload, self.cfg.use_vllm_tokenizer,
                                     self.engine.vllm_config.parallel_config.data_parallel_size)

    def failure(self) -> str | None:
        return "engine is dead" if self.engine.errored else None

    async def died(self) -> str:
        # Ranks on other nodes (--headless): vLLM's client does not notice one that stopped or died, and would
        # route to it for ever. Each is pinged now and then (an engine answers between two steps).
        remote = range(self.cfg.engine_args.data_parallel_size_local or 0, self.cfg.data_parallel_size) \
            if self.cfg.remote_ranks else range(0)
        since_ping = 0.0
        while True:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
            try:
                await self.engine.check_health()
            except Exception as exc:
                return f"vLLM engine: {type(exc).__name__}: {exc}"
            since_ping += ENGINE_CHECK_INTERVAL_S
            if remote and since_ping >= REMOTE_RANK_PING_S:
                since_ping = 0.0
                for rank in remote:
                    try:
                        await asyncio.wait_for(ping_engine_rank(self.engine, rank), REMOTE_RANK_TIMEOUT_S)
                    except TimeoutError:
                        return (f"data-parallel rank {rank} (on a --headless node) did not answer for "
                                f"{REMOTE_RANK_TIMEOUT_S:.0f} s: its node stopped or died")

    def refresh_gauges(self) -> None:
        if self.engine is not None and self.metrics is not None:
            self.metrics.engine_unfinished.set(unfinished_requests(self.engine))

    def serving(self) -> None:
        log.info("worker %s serving %r at %s", self.instance_id, self.cfg.served_model_name, self._server.address)

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self._relay_task is not None:
            self._relay_task.cancel()
            self.relay.close()
        if self.events is not None:
            self.events.close()


def main(argv: list[str] | None = None) -> int:
    setup_logging(argv, "python -m turbine.vllm")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    for name, value in engine_env_defaults().items():
        os.environ.setdefault(name, value)
    cfg = parse_worker_args(argv)
    if (warning := unknown_release_warning()) is not None:
        log.warning(warning)
    if setup_tracing(argv, "turbine-worker") and getattr(cfg.engine_args, "otlp_traces_endpoint", None) is None:
        # Set by the environment only: the engine traces too (its spans join the request's trace).
        cfg.engine_args.otlp_traces_endpoint = os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if cfg.headless:
        from turbine.vllm.headless import HeadlessNode

        return run_host(HeadlessNode(cfg).run)
    if cfg.omni:  # parse_worker_args refused it where vllm-omni cannot run
        from turbine.vllm.omni_worker import OmniEngine

        return run_host(WorkerHost(cfg, OmniEngine(cfg)).run)
    if cfg.multimodal_encode_worker:
        from turbine.vllm.encode_worker import EncodeEngine

        return run_host(WorkerHost(cfg, EncodeEngine(cfg)).run)
    return run_host(WorkerHost(cfg, VllmEngine(cfg)).run)


def image_token_id(hf_config) -> int | None:
    """The image placeholder's token id, under the names vision-language configs give it (None: unknown)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path) as f:
        return f.read()

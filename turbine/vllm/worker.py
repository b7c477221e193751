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
from turbine.vllm.args import WorkerConfig, parse_worker_args
from turbine.vllm.canary import generate_canary, pooling_canary
from turbine.vllm.compat import ping_engine_rank, unfinished_requests, unknown_release_warning
from turbine.vllm.embed import EmbedHandlers
from turbine.vllm.images import measured_placeholder
from turbine.vllm.connectors import claim_nixl_side_channel, keep_model_runner_v1, uses_kvbm, uses_nixl
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.vllm.headless import node_group
from turbine.vllm.kv_events_relay import VllmKvEventsRelay
from turbine.vllm.kvbm_connector import kv_shared_tier
from turbine.vllm.lora import VllmLora
from turbine.vllm.load_metrics import stat_logger_factory
from turbine.vllm.sleep import VllmSleep, platform_sleep_refusal
from turbine.worker.config import EMBEDDINGS
from turbine.worker.events import InstanceEvents
from turbine.worker.host import Instance, WorkerHost, run_host

log = logging.getLogger("turbine.vllm")

ENGINE_CHECK_INTERVAL_S = 2.0
REMOTE_RANK_PING_S = 4.0
# An engine answers a ping between two steps; a step this long (a huge prefill on a slow CPU) would be taken for
# a dead node.
REMOTE_RANK_TIMEOUT_S = 20.0


class VllmEngine:
    """vLLM as an engine kind for the worker host: one instance."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.metrics = WorkerMetrics({"namespace": cfg.namespace, "component": cfg.component,
                                      "model": cfg.served_model_name, "worker_id": self.instance_id},
                                     data_parallel_size=cfg.data_parallel_size)
        self.engine: AsyncLLM | None = None
        self.events: InstanceEvents | None = None
        self.relay: VllmKvEventsRelay | None = None
        self._relay_task: asyncio.Task | None = None
        self._server: RequestPlaneServer | None = None
        self.pooling = False
        self._handlers = None  # the role's generate handlers, or the pooling worker's embed handlers (the canary)

    async def build(self) -> None:
        """Nothing: start() builds the engine, after the event plane its relay and load reports need."""

    def checkpoint_refusal(self) -> str | None:
        # Checkpoint mode quiesces the engine by sleeping it, and needs the engine built before
        # any socket; neither is done for vLLM yet, so it is refused, never half-run.
        reason = platform_sleep_refusal() or "the vLLM worker does not build its engine before its sockets yet"
        return f"the vLLM worker cannot be checkpointed: {reason}"

    async def quiesce(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def resume(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    def restore_identity(self, identity) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def start(self, plane: WorkerEventPlane, health: Health) -> list[Instance]:
        cfg = self.cfg
        ranks = cfg.data_parallel_size
        if uses_nixl(cfg.engine_args.kv_transfer_config):
            port = claim_nixl_side_channel(advertised_host(cfg.host), ranks)
            log.info("NIXL side channel on port %d", port)
        if uses_kvbm(cfg.engine_args.kv_transfer_config):
            keep_model_runner_v1()  # its failed loads are rewound right by V1 only (turbine.vllm.connectors)

        # Load reports go out whatever the role or prefix caching. With prefix caching on, the
        # engine's KV events are relayed for KV routers. Decode workers relay none (routing picks
        # prefill workers by their caches, decode workers by load) but keep empty publishers, so
        # routers follow their address for their load and get an empty cache on replay.
        relays = cfg.engine_args.enable_prefix_caching and not cfg.is_decode
        self.events = InstanceEvents(plane, self.instance_id, data_parallel_size=ranks,
                                     kv_events=relays or cfg.is_decode, kv_events_buffer=cfg.kv_events_buffer)
        if relays:
            # Ranks on other nodes publish to the relay over the data-parallel network (the one vLLM's own engine
            # handshake and outputs cross), so it listens there; otherwise on loopback.
            host = cfg.data_parallel_address if cfg.remote_ranks else "127.0.0.1"
            self.relay = VllmKvEventsRelay(self.events.kv, port=cfg.kv_events_port, host=host)
            cfg.engine_args.kv_events_config = self.relay.engine_config()
            self._relay_task = asyncio.create_task(self.relay.run())
        # vLLM's stat-logger hook feeds the load reports and the worker's KV gauges of each rank.
        stat_loggers = [stat_logger_factory(self.events.load, self.metrics.ranks)]

        if cfg.take_image_embeddings:
            # The engine's encoder-cache connector loads the embeddings encode workers made (ec_connector.py).
            from vllm.config import ECTransferConfig

            from turbine.vllm.ec_connector import engine_config

            cfg.engine_args.ec_transfer_config = ECTransferConfig(**engine_config())
        building = time.monotonic()
        engine = self.engine = AsyncLLM.from_engine_args(cfg.engine_args, stat_loggers=stat_loggers)
        self.metrics.model_load_seconds.set(time.monotonic() - building)
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
        if self.engine is not None:
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

"""The vLLM worker process: engine + request-plane endpoints + discovery + status server.

Lifecycle: start the engine, serve endpoints, register (instance records, then the model
card: only then is it ready). SIGTERM/SIGINT: unregister first, let in-flight requests
finish within the grace period, exit 0. Engine death: unregister, exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from turbine.protocol.generate import ClearKvBlocksRequest, GenerateRequest
from turbine.runtime.event_plane import EventPlaneError
from turbine.runtime.kv_replay import serve_kv_replay
from turbine.runtime.registration import CLEAR_KV_BLOCKS
from turbine.vllm.args import WorkerConfig

log = logging.getLogger("turbine.vllm")

ENGINE_CHECK_INTERVAL_S = 2.0
EXIT_ENGINE_DEAD = 3
EXIT_BAD_CONFIG = 2  # as argparse: a flag names something unusable (e.g. --nats-server)


class Worker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.stopping = asyncio.Event()
        self.exit_code = 0

    async def run(self) -> int:
        from vllm.v1.engine.async_llm import AsyncLLM

        from turbine.config import make_registry
        from turbine.model.prepare import tokenizer_folder
        from turbine.runtime.lifecycle import drain_and_stop, stop_on_signals
        from turbine.runtime.registration import advertised_address, register, unregister
        from turbine.runtime.request_plane import RequestPlaneServer
        from turbine.runtime.status_server import Health, make_app, serve_status
        from turbine.runtime.worker_metrics import WorkerMetrics
        from turbine.runtime.registration import advertised_host
        from turbine.vllm.canary import engine_canary
        from turbine.vllm.connectors import claim_nixl_side_channel, uses_nixl
        from turbine.vllm.handlers import Handlers
        from turbine.vllm.load_metrics import stat_logger_factory

        cfg = self.cfg
        stop_on_signals(self.stopping)

        health = Health()
        metrics = WorkerMetrics({"namespace": cfg.namespace, "component": cfg.component,
                                 "model": cfg.served_model_name, "worker_id": self.instance_id})
        engine = None
        status_server = None
        if cfg.system_port is not None:
            def refresh_gauges():
                if engine is not None:
                    metrics.engine_unfinished.set(engine.get_num_unfinished_requests())
            status_server = await serve_status(make_app(health, refresh_gauges), cfg.system_host, cfg.system_port)
            log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)

        if uses_nixl(cfg.engine_args.kv_transfer_config):
            port = claim_nixl_side_channel(advertised_host(cfg.host),
                                           cfg.engine_args.data_parallel_size or 1)
            log.info("NIXL side channel on port %d", port)

        # With prefix caching on, the engine's KV events are relayed to the event plane for KV
        # routers, unless the user configured vLLM's KV events themselves. Decode workers do
        # not publish: routing picks prefill workers by their caches, decode workers by load.
        relay = plane = None
        if (cfg.engine_args.enable_prefix_caching and cfg.engine_args.kv_events_config is None
                and not cfg.is_decode):
            from turbine.runtime.event_plane import WorkerEventPlane
            from turbine.runtime.kv_publisher import KvEventPublisher
            from turbine.vllm.kv_events_relay import VllmKvEventsRelay

            # Before the engine: an unreachable NATS server fails the start at once.
            plane = await WorkerEventPlane.open(cfg.event_plane, cfg.host, cfg.nats_server)
            events_plane = plane.publisher(self.instance_id)  # one for every data-parallel rank
            relay = VllmKvEventsRelay([
                KvEventPublisher(self.instance_id, dp_rank=rank, events_plane=events_plane,
                                 buffer_size=cfg.kv_events_buffer)
                for rank in range(cfg.engine_args.data_parallel_size or 1)])
            cfg.engine_args.kv_events_config = relay.engine_config()
            relay_task = asyncio.create_task(relay.run())

        # Load metrics for KV routers go out on the same event plane, from vLLM's stat-logger
        # hook. Without KV events there is no event plane, and no load metrics either; the
        # hook still keeps the worker's active-blocks gauge.
        load = None
        if relay is not None:
            from turbine.runtime.load_publisher import LoadMetricsPublisher

            load = LoadMetricsPublisher(relay.publisher.events_plane, self.instance_id)
        stat_loggers = [stat_logger_factory(load, metrics.active_kv_blocks)]

        engine = AsyncLLM.from_engine_args(cfg.engine_args, stat_loggers=stat_loggers)
        vcfg = engine.vllm_config
        metrics.total_kv_blocks.set(vcfg.cache_config.num_gpu_blocks or 0)
        handlers = Handlers(engine, metrics, on_cleared=relay.cleared if relay else None,
                            role=cfg.disaggregation_mode, kv_transfer_timeout=cfg.kv_transfer_timeout,
                            on_success=health.succeeded)

        server = RequestPlaneServer(host=cfg.host, port=cfg.port)
        server.register(cfg.endpoint, GenerateRequest, handlers.generate)
        server.register(CLEAR_KV_BLOCKS, ClearKvBlocksRequest, handlers.clear_kv_blocks)
        if relay is not None:
            serve_kv_replay(server, relay.publishers)  # routers that missed events recover here
        await server.start()

        registry = make_registry(cfg.discovery)
        await registry.backend.start()
        try:
            sched = vcfg.scheduler_config
            card = cfg.model_card(
                self.instance_id, engine="vllm", tokenizer_path=tokenizer_folder(cfg.model_path),
                context_length=vcfg.model_config.max_model_len, kv_block_size=vcfg.cache_config.block_size,
                total_kv_blocks=vcfg.cache_config.num_gpu_blocks or 0, max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                kv_events_address=relay.publisher.address if relay else None)
            records = await register(registry, card, advertised_address(server.address))
            health.set_ready(lambda: engine_canary(engine),
                             failure=lambda: "engine is dead" if engine.errored else None)
            log.info("worker %s serving %r at %s", self.instance_id, cfg.served_model_name, server.address)
            monitor = asyncio.create_task(self._monitor_engine(engine))
            await self.stopping.wait()
            monitor.cancel()
            health.set_not_ready()
            # Unregister first so no new traffic arrives, then let in-flight requests finish.
            await unregister(registry, records)
            await drain_and_stop([server], cfg.graceful_shutdown_timeout if self.exit_code == 0 else 0)
        finally:
            await registry.backend.close()
            if status_server is not None:
                status_server.should_exit = True
            engine.shutdown()
            if load is not None:
                load.close()
            if relay is not None:
                relay_task.cancel()
                relay.close()
            if plane is not None:
                await plane.close()
        return self.exit_code

    async def _monitor_engine(self, engine) -> None:
        while True:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
            try:
                await engine.check_health()
            except Exception as exc:
                log.error("vLLM engine is dead (%s: %s); unregistering and exiting", type(exc).__name__, exc)
                self.exit_code = EXIT_ENGINE_DEAD
                self.stopping.set()
                return


def main(argv: list[str] | None = None) -> int:
    from turbine.logging_setup import setup_logging
    from turbine.vllm.args import parse_worker_args

    setup_logging()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    cfg = parse_worker_args(argv)
    try:
        return asyncio.run(Worker(cfg).run())
    except EventPlaneError as exc:
        log.error("%s", exc)
        return EXIT_BAD_CONFIG

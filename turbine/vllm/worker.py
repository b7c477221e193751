"""The vLLM worker process: engine + request-plane endpoints + discovery + status server.

Lifecycle: start the engine, serve endpoints, register (instance records, then the model
card: only then is it ready). SIGTERM/SIGINT: unregister first, let in-flight requests
finish within the grace period, exit 0. Engine death: unregister, exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid

from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import ClearKvBlocksRequest, GenerateRequest
from turbine.vllm.args import WorkerConfig

log = logging.getLogger("turbine.vllm")

ENGINE_CHECK_INTERVAL_S = 2.0
EXIT_ENGINE_DEAD = 3


def advertised_address(bound: str) -> str:
    """A wildcard bind (0.0.0.0 / ::) is not an address others can dial: publish this host's."""
    host, _, port = bound.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def tokenizer_folder(model_path: str) -> str:
    """The frontend needs the tokenizer files locally; for a hub id, find the cached copy."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, allow_patterns=["*.json", "*.jinja", "tokenizer*"])


class Worker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.records: list[InstanceRecord] = []
        self.card: ModelCard | None = None

    async def run(self) -> int:
        from vllm.v1.engine.async_llm import AsyncLLM

        from turbine.config import make_registry
        from turbine.runtime.request_plane import RequestPlaneServer
        from turbine.vllm.handlers import Handlers
        from turbine.vllm.metrics import WorkerMetrics
        from turbine.vllm.status_server import WorkerStatus, make_app, serve_status

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

        status = WorkerStatus()
        metrics = WorkerMetrics({"namespace": cfg.namespace, "component": cfg.component,
                                 "model": cfg.served_model_name, "worker_id": self.instance_id})
        status_server = None
        if cfg.system_port is not None:
            def refresh_gauges():
                if status.engine is not None:
                    metrics.engine_unfinished.set(status.engine.get_num_unfinished_requests())
            status_server = await serve_status(make_app(status, refresh_gauges), cfg.system_host, cfg.system_port)
            log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)

        engine = AsyncLLM.from_engine_args(cfg.engine_args)
        status.engine = engine
        vcfg = engine.vllm_config
        metrics.total_kv_blocks.set(vcfg.cache_config.num_gpu_blocks or 0)
        handlers = Handlers(engine, metrics)

        server = RequestPlaneServer(host=cfg.host, port=cfg.port)
        server.register("generate", GenerateRequest, self._track(handlers.generate, status))
        server.register("clear_kv_blocks", ClearKvBlocksRequest, handlers.clear_kv_blocks)
        await server.start()

        registry = make_registry(cfg.discovery)
        await registry.backend.start()
        try:
            await self._register(registry, advertised_address(server.address), vcfg)
            status.ready = True
            log.info("worker %s serving %r at %s", self.instance_id, cfg.served_model_name, server.address)
            monitor = asyncio.create_task(self._monitor_engine(engine))
            await self.stopping.wait()
            monitor.cancel()
            status.ready = False
            # Unregister first so no new traffic arrives, then let in-flight requests finish.
            await self._unregister(registry)
            if self.exit_code == 0 and server.inflight:
                log.info("waiting up to %.0fs for %d in-flight requests", cfg.graceful_shutdown_timeout,
                         server.inflight)
                await server.drain(cfg.graceful_shutdown_timeout)
            await server.stop()
        finally:
            await registry.backend.close()
            if status_server is not None:
                status_server.should_exit = True
            engine.shutdown()
        return self.exit_code

    def _track(self, generate, status):
        import time

        async def tracked(req, ctx):
            async for chunk in generate(req, ctx):
                yield chunk
            status.last_success = time.monotonic()

        return tracked

    async def _register(self, registry, address: str, vcfg) -> None:
        cfg = self.cfg
        common = dict(namespace=cfg.namespace, component=cfg.component, instance_id=self.instance_id,
                      address=address, pid=os.getpid(), hostname=socket.gethostname())
        self.records = [InstanceRecord(endpoint=cfg.endpoint, **common),
                        InstanceRecord(endpoint="clear_kv_blocks", **common)]
        for rec in self.records:
            await registry.register_instance(rec)
        sched = vcfg.scheduler_config
        self.card = ModelCard(
            name=cfg.served_model_name, namespace=cfg.namespace, component=cfg.component,
            endpoint=cfg.endpoint, instance_id=self.instance_id, engine="vllm",
            tokenizer_path=tokenizer_folder(cfg.model_path),
            chat_template_path=cfg.custom_jinja_template,
            context_length=vcfg.model_config.max_model_len,
            kv_block_size=vcfg.cache_config.block_size,
            total_kv_blocks=vcfg.cache_config.num_gpu_blocks or 0,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            endpoint_types=list(cfg.endpoint_types), tool_call_parser=cfg.tool_call_parser,
            reasoning_parser=cfg.reasoning_parser, migration_limit=cfg.migration_limit,
        )
        await registry.register_model(self.card)

    async def _unregister(self, registry) -> None:
        for rec in self.records:
            try:
                await registry.unregister_instance(rec)
            except Exception as exc:  # discovery down: the TTL removes us anyway
                log.warning("could not unregister %s: %s", rec.path, exc)

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
    return asyncio.run(Worker(cfg).run())

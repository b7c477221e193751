"""The mocker process: N simulated workers, each registered and served exactly like one
vLLM worker (its own instance id, request-plane server, discovery records and model card),
sharing one discovery lease and one status server.

Lifecycle as the vLLM worker's: serve, register, ready. SIGTERM/SIGINT: unregister every
worker first, let in-flight requests finish within the grace period, exit 0. A simulated
engine that crashes (a bug) takes the process down the same way, exiting non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from turbine.mocker.args import MockerConfig
from turbine.mocker.engine import MockEngine
from turbine.mocker.handlers import Handlers
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.metrics import EngineGauges
from turbine.mocker.scheduler import Scheduler
from turbine.mocker.tokens import TokenSampler
from turbine.protocol.generate import ClearKvBlocksRequest, GenerateRequest, StopConditions
from turbine.runtime.event_plane import EventPlaneError, WorkerEventPlane
from turbine.runtime.gc_pacing import freeze_start_up_heap, pace_garbage_collection
from turbine.runtime.kv_publisher import KvEventPublisher
from turbine.runtime.kv_replay import serve_kv_replay
from turbine.runtime.load_publisher import LoadMetricsPublisher
from turbine.runtime.registration import CLEAR_KV_BLOCKS
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.status_server import Health
from turbine.runtime.worker_metrics import WorkerMetrics

log = logging.getLogger("turbine.mocker")

EXIT_ENGINE_DEAD = 3
EXIT_BAD_CONFIG = 2  # as argparse: a flag names something unusable (e.g. --nats-server)
CANARY_TIMEOUT_S = 10.0


class SimulatedWorker:
    """One simulated worker: engine, handlers and request-plane server of one instance."""

    def __init__(self, cfg: MockerConfig, sampler: TokenSampler, health: Health,
                 plane: WorkerEventPlane | None = None):
        self.instance_id = uuid.uuid4().hex[:16]
        labels = {"namespace": cfg.namespace, "component": cfg.component, "model": cfg.served_model_name,
                  "worker_id": self.instance_id}
        # With prefix caching on, the pool's events go out on the event plane for KV routers,
        # and the engine's load metrics with them (as the vLLM worker does). A decode worker
        # publishes no KV events (its cache holds what prefill workers computed; routers want
        # those), but keeps the publisher for its load metrics, and answers replays with an
        # empty cache.
        self.kv_events = None
        if cfg.enable_prefix_caching:
            self.kv_events = KvEventPublisher(self.instance_id, cfg.host, buffer_size=cfg.kv_events_buffer,
                                              events_plane=plane.publisher(self.instance_id) if plane else None)
        self.load = LoadMetricsPublisher(self.kv_events.events_plane, self.instance_id) if self.kv_events else None
        pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                         on_event=None if cfg.is_decode else self._pool_events(cfg.kv_events_drop_after))
        scheduler = Scheduler(pool, sampler, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len)
        self.engine = MockEngine(scheduler, cfg.timing, cfg.speedup_ratio,
                                 on_step=self._publish_load if self.load else None, kv_transfer=cfg.kv_transfer)
        if self.load is not None:
            self._publish_load(scheduler)  # the idle state, re-sent until it changes (keepalive)
        self.metrics = WorkerMetrics(labels)
        self.metrics.total_kv_blocks.set(cfg.num_gpu_blocks)
        self.gauges = EngineGauges(labels, scheduler)
        self.handlers = Handlers(self.engine, self.metrics, cfg.model_info.vocab_size,
                                 disaggregation_mode=cfg.disaggregation_mode, instance_id=self.instance_id,
                                 on_success=health.succeeded)
        self.server = RequestPlaneServer(host=cfg.host, port=cfg.port)
        self.server.register(cfg.endpoint, GenerateRequest, self.handlers.generate)
        self.server.register(CLEAR_KV_BLOCKS, ClearKvBlocksRequest, self.handlers.clear_kv_blocks)
        if self.kv_events is not None:
            serve_kv_replay(self.server, [self.kv_events])  # routers that missed events recover here
        self.card = cfg.model_card(
            self.instance_id, engine="mocker", tokenizer_path=cfg.tokenizer_path,
            context_length=cfg.max_model_len, kv_block_size=cfg.block_size, total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_events_address=self.kv_events.address if self.kv_events else None)

    def _pool_events(self, drop_after: int | None):
        """Where the block pool's events go. `drop_after` (the --kv-events-drop-after test hook)
        publishes that many and silently drops the rest, to exercise routers' warnings."""
        if self.kv_events is None:
            return None
        publish = self.kv_events.publish
        if drop_after is None:
            return lambda event: publish([event])
        left = drop_after

        def publish_then_drop(event) -> None:
            nonlocal left
            if left > 0:
                left -= 1
                publish([event])

        return publish_then_drop

    def _publish_load(self, sched: Scheduler) -> None:
        # Requests pulling their KV count as waiting, as in vLLM (they sit in its waiting queue).
        self.load.update(0, kv_active_blocks=sched.pool.num_in_use, kv_total_blocks=sched.pool.num_blocks,
                         num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.pulling))

    def refresh_gauges(self) -> None:
        sched = self.engine.scheduler
        self.metrics.engine_unfinished.set(len(sched.waiting) + len(sched.running) + len(sched.pulling))
        self.gauges.refresh()

    async def canary(self) -> str | None:
        """Generate one token on this worker's engine (not counted as a served request)."""
        req = GenerateRequest(request_id=f"canary-{uuid.uuid4().hex[:8]}", model="", token_ids=[1],
                              stop=StopConditions(max_tokens=1))
        seqs = self.handlers.sequences(req)
        outputs = self.engine.submit(seqs)
        try:
            async with asyncio.timeout(CANARY_TIMEOUT_S):
                while all(out.finish_reason is None for out in await outputs.take()):
                    pass
        except TimeoutError:
            self.engine.abort(seqs)
            return f"worker {self.instance_id}: canary did not finish in {CANARY_TIMEOUT_S:.0f}s"
        return None


class Mocker:
    def __init__(self, cfg: MockerConfig):
        self.cfg = cfg
        self.stopping = asyncio.Event()
        self.exit_code = 0

    async def run(self) -> int:
        from turbine.config import make_registry
        from turbine.runtime.lifecycle import drain_and_stop, stop_on_signals
        from turbine.runtime.registration import advertised_address, register, unregister
        from turbine.runtime.status_server import make_app, serve_status

        cfg = self.cfg
        stop_on_signals(self.stopping)
        health = Health()
        info = cfg.model_info
        sampler = TokenSampler(info.vocab_size, info.eos_token_ids, info.special_token_ids, cfg.natural_output_len,
                               info.word_token_ids)
        plane = None
        if cfg.enable_prefix_caching:  # one event plane for all the workers here (nats: one connection)
            plane = await WorkerEventPlane.open(cfg.event_plane, cfg.host, cfg.nats_server)
        workers = [SimulatedWorker(cfg, sampler, health, plane) for _ in range(cfg.num_workers)]

        status_server = None
        if cfg.system_port is not None:
            def refresh_gauges():
                for w in workers:
                    w.refresh_gauges()
            status_server = await serve_status(make_app(health, refresh_gauges), cfg.system_host, cfg.system_port)
            log.info("status server on http://%s:%d", cfg.system_host, cfg.system_port)

        engines = [asyncio.create_task(w.engine.run()) for w in workers]
        for task in engines:
            task.add_done_callback(self._engine_stopped)
        servers = [w.server for w in workers]
        for server in servers:
            await server.start()

        registry = make_registry(cfg.discovery)
        await registry.backend.start()
        gc_pacing = None
        try:
            records = []
            for w in workers:
                records += await register(registry, w.card, advertised_address(w.server.address))
            health.set_ready(lambda: _first_failure([w.canary() for w in workers]))
            log.info("%d simulated worker(s) serving %r", len(workers), cfg.served_model_name)
            # The collector's automatic passes would stall every simulated worker's step at
            # once, several times a second, and find nothing (gc_pacing.py).
            if cfg.gc_interval > 0:
                gc_pacing = pace_garbage_collection(cfg.gc_interval)
            else:
                freeze_start_up_heap()
            await self.stopping.wait()
            health.set_not_ready()
            # Unregister first so no new traffic arrives, then let in-flight requests finish.
            await unregister(registry, records)
            await drain_and_stop(servers, cfg.graceful_shutdown_timeout if self.exit_code == 0 else 0)
        finally:
            if gc_pacing is not None:
                gc_pacing.cancel()
            for task in engines:
                task.remove_done_callback(self._engine_stopped)
                task.cancel()
            for w in workers:
                if w.load is not None:
                    w.load.close()
            await registry.backend.close()
            if status_server is not None:
                status_server.should_exit = True
            if plane is not None:
                await plane.close()
        return self.exit_code

    def _engine_stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            log.error("a simulated engine stopped: %r; unregistering and exiting", task.exception())
            self.exit_code = EXIT_ENGINE_DEAD
            self.stopping.set()


async def _first_failure(canaries) -> str | None:
    for reason in await asyncio.gather(*canaries):
        if reason:
            return reason
    return None


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from turbine.logging_setup import setup_logging
    from turbine.mocker.args import parse_mocker_args

    setup_logging()
    cfg = parse_mocker_args(argv)
    # uvloop: the event loop is most of the work of 100+ simulated workers.
    try:
        return uvloop.run(Mocker(cfg).run())
    except EventPlaneError as exc:
        log.error("%s", exc)
        return EXIT_BAD_CONFIG

"""The mocker process: N simulated workers, each registered and served exactly like one
vLLM worker (its own instance id, request-plane server, discovery records and model card),
sharing one discovery lease and one status server. The worker host (turbine/worker/host.py)
runs the process; this module builds the simulated engines.

With --data-parallel-size N each worker runs N engines (ranks), each with its own block pool,
scheduler, KV events (dp_rank = its rank) and load reports; a request's dp_rank picks one.
A simulated engine that crashes (a bug) takes the process down as a dead vLLM engine does.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

from turbine.logging_setup import setup_logging
from turbine.mocker.args import MockerConfig, parse_mocker_args
from turbine.mocker.engine import MockEngine
from turbine.mocker.handlers import HANDLERS_OF_ROLE
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.kv_tiers import KvTiers
from turbine.mocker.metrics import EngineGauges
from turbine.mocker.scheduler import Scheduler
from turbine.mocker.tokens import TokenSampler
from turbine.protocol.generate import ClearKvBlocksRequest, GenerateRequest
from turbine.runtime.event_plane import WorkerEventPlane
from turbine.runtime.gc_pacing import pace_garbage_collection
from turbine.worker.kv_publisher import KvEventPublisher
from turbine.worker.lora_slots import LoraSlots
from turbine.runtime.registration import CLEAR_KV_BLOCKS
from turbine.runtime.status_server import Health
from turbine.tracing import setup_tracing
from turbine.worker.worker_metrics import WorkerMetrics
from turbine.worker.events import InstanceEvents
from turbine.runtime.errors import InvalidRequest
from turbine.worker import health_check
from turbine.worker.health_check import PayloadError
from turbine.worker.host import Instance, WorkerHost, run_host
from turbine.worker.snapshot import RestoredIdentity

log = logging.getLogger("turbine.mocker")

CANARY_TIMEOUT_S = 10.0


class WorkerEngines:
    """One simulated worker's engines, one per data-parallel rank: built before any socket is
    opened (checkpoint mode), wired to the event plane by SimulatedWorker."""

    def __init__(self, cfg: MockerConfig, sampler: TokenSampler):
        self.engines: list[MockEngine] = []
        for _ in range(cfg.data_parallel_size):
            pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching)
            tiers = KvTiers(cfg.kv_tiers, cfg.block_size, cfg.kv_block_bytes) if cfg.kv_tiers else None
            scheduler = Scheduler(pool, sampler, max_num_seqs=cfg.max_num_seqs,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
                                  lora_slots=LoraSlots(cfg.lora_slots) if cfg.enable_lora else None, tiers=tiers)
            self.engines.append(MockEngine(scheduler, cfg.timing, cfg.speedup_ratio, kv_transfer=cfg.kv_transfer,
                                           lora_load_ms=cfg.lora_load_ms))
        self.level = 0  # sleep level, 0: awake
        self.sleep_time, self.wake_time = cfg.sleep_time, cfg.wake_time
        self.build_seconds = 0.0  # set by SimulatedEngines.build (turbine_worker_model_load_seconds)

    async def sleep(self, level: int) -> None:
        """Free the simulated KV cache: every cached block is dropped (AllBlocksCleared goes
        out), as vLLM discards its KV cache. The mocker has no weights: level 2 frees the same."""
        for rank, engine in enumerate(self.engines):
            if not engine.scheduler.pool.reset():
                raise RuntimeError(f"rank {rank}: KV blocks still in use, cannot sleep")
        self.level = level
        if self.sleep_time > 0:  # --sleep-time: a GPU engine's sleep, its memory moved or freed
            await asyncio.sleep(self.sleep_time)

    async def wake_up(self) -> None:
        if self.wake_time > 0:  # --wake-time: a GPU engine's wake (the weights back, the KV cache allocated)
            await asyncio.sleep(self.wake_time)
        self.level = 0


class SimulatedWorker:
    """One simulated worker: its engines (one per data-parallel rank), handlers and
    request-plane server of one instance."""

    def __init__(self, cfg: MockerConfig, engines: WorkerEngines, health: Health, plane: WorkerEventPlane,
                 instance_id: str):
        self.instance_id = instance_id
        self.cfg = cfg
        labels = {"namespace": cfg.namespace, "component": cfg.component, "model": cfg.served_model_name,
                  "worker_id": self.instance_id}
        # Load reports go out whatever the role or prefix caching. KV events: with prefix caching
        # on, the pools' events go out for KV routers. A decode worker publishes none (its cache
        # holds what prefill workers computed; routers want those) but keeps the publishers, so
        # that routers follow its address (for its load) and get an empty cache on replay.
        self.events = InstanceEvents(plane, self.instance_id, data_parallel_size=cfg.data_parallel_size,
                                     kv_events=cfg.enable_prefix_caching or cfg.is_decode,
                                     kv_events_buffer=cfg.kv_events_buffer)
        self.worker_engines = engines
        self.engines = engines.engines
        for rank, engine in enumerate(self.engines):
            if self.events.kv and cfg.enable_prefix_caching and not cfg.is_decode:
                engine.scheduler.pool.on_event = _pool_events(self.events.kv[rank], cfg.kv_events_drop_after)
                if engine.scheduler.tiers is not None:  # the consolidated tier events, on the same stream
                    engine.scheduler.tiers.on_event = engine.scheduler.pool.on_event
            engine.on_step = self._load_reporter(rank)
            self._publish_load(rank, engine.scheduler)  # the idle state, re-sent until it changes (keepalive)
        self.metrics = WorkerMetrics(labels, data_parallel_size=cfg.data_parallel_size)
        self.metrics.set_total_kv_blocks(0 if engines.level else cfg.num_gpu_blocks)
        self.metrics.model_load_seconds.set(engines.build_seconds)
        self.gauges = EngineGauges(labels, [e.scheduler for e in self.engines])
        self.handlers = HANDLERS_OF_ROLE[cfg.disaggregation_mode](
            self.engines, self.metrics, cfg.model_info.vocab_size, instance_id=self.instance_id,
            on_success=health.succeeded, admission=cfg.admission(self.metrics))
        self.server = cfg.request_plane_config.server(cfg.host, cfg.port)
        self.server.register(cfg.endpoint, GenerateRequest, self.handlers.generate)
        self.server.register(CLEAR_KV_BLOCKS, ClearKvBlocksRequest, self.handlers.clear_kv_blocks)
        self.events.serve_replay(self.server)
        self.adapters: dict[str, int] = {}  # LoRA adapter name -> id (what requests may name)
        self.handlers.adapters = self.adapters
        self.card = cfg.model_card(
            self.instance_id, engine="mocker", tokenizer_path=cfg.tokenizer_path,
            context_length=cfg.max_model_len, kv_block_size=cfg.block_size, total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            data_parallel_size=cfg.data_parallel_size, **self.events.card_fields())

    # Its sleep (turbine/worker/sleep.py runs the sequence around it): the KV gauge shows it.
    def sleep_refusal(self, level: int) -> str | None:
        return None

    async def sleep(self, level: int) -> None:
        await self.worker_engines.sleep(level)
        self.metrics.set_total_kv_blocks(0)

    async def wake_up(self) -> None:
        level, waking = self.worker_engines.level, time.monotonic()
        await self.worker_engines.wake_up()
        if level == 2:  # the weights "loaded again" (the mocker has none: the wake's own time)
            self.metrics.model_load_seconds.set(time.monotonic() - waking)
        self.metrics.set_total_kv_blocks(self.cfg.num_gpu_blocks)

    # Its LoRA adapters (turbine/worker/lora.py checks them and runs the load / unload sequence).
    def lora_refusal(self) -> str | None:
        return None if self.cfg.enable_lora else "this worker takes no LoRA adapters: start it with --enable-lora"

    @property
    def max_lora_rank(self) -> int | None:
        return self.cfg.max_lora_rank

    @property
    def base_model_dir(self) -> str | None:
        return self.cfg.tokenizer_path  # the model's folder (config and, for real models, weights)

    async def add(self, name: str, lora_id: int, path: str) -> None:
        self.adapters[name] = lora_id

    async def remove(self, name: str, lora_id: int) -> None:
        self.adapters.pop(name, None)
        for engine in self.engines:  # its active slot is free again, as vLLM's remove_lora frees it
            if engine.scheduler.lora_slots is not None:
                engine.scheduler.lora_slots.discard(name)

    def _load_reporter(self, rank: int):
        return lambda scheduler: self._publish_load(rank, scheduler)

    def _publish_load(self, rank: int, sched: Scheduler) -> None:
        slots = sched.lora_slots
        self.events.load.update(rank, kv_active_blocks=sched.pool.num_in_use, kv_total_blocks=sched.pool.num_blocks,
                                num_running=len(sched.running), num_waiting=sched.num_queued,
                                max_loras=slots.capacity if slots else 0, active_loras=slots.resident if slots else ())

    def refresh_gauges(self) -> None:
        self.metrics.engine_unfinished.set(sum(e.scheduler.num_unfinished for e in self.engines))
        for gauges, engine in zip(self.metrics.ranks, self.engines):
            pool = engine.scheduler.pool
            gauges.active_kv_blocks.set(pool.num_in_use)
            gauges.kv_cache_usage.set(pool.num_in_use / pool.num_blocks if pool.num_blocks else 0.0)
        self.gauges.refresh()

    async def canary(self) -> str | None:
        """The health check's payload (turbine/worker/health_check.py) through the role's checks on each of
        this worker's engines (not counted as served requests)."""
        if self.worker_engines.level:
            return None  # asleep: its cache is gone and nothing is routed here
        payload = self.cfg.health_check_payload
        source = f" (the {health_check.FLAG} payload)" if payload is not None else ""
        for rank, engine in enumerate(self.engines):
            try:
                req = health_check.generate_request(payload, bos=self.cfg.model_info.bos_token_id or health_check.DEFAULT_BOS,
                                                    text_mode=False, dp_rank=rank)
                seqs = self.handlers.sequences(req)
            except (PayloadError, InvalidRequest) as exc:
                message = exc.error.message if isinstance(exc, InvalidRequest) else str(exc)
                return f"worker {self.instance_id}: canary generate refused{source}: {message}"
            outputs = engine.submit(seqs)
            try:
                async with asyncio.timeout(CANARY_TIMEOUT_S):
                    while all(out.finish_reason is None for out in await outputs.take()):
                        pass
            except TimeoutError:
                engine.abort(seqs)
                return f"worker {self.instance_id} rank {rank}: canary did not finish in {CANARY_TIMEOUT_S:.0f}s"
        return None

    def close(self) -> None:
        self.events.close()


def _pool_events(publisher: KvEventPublisher, drop_after: int | None):
    """Where a block pool's events go. `drop_after` (the --kv-events-drop-after test hook)
    publishes that many and silently drops the rest, to exercise routers' warnings."""
    publish = publisher.publish
    if drop_after is None:
        return lambda event, lora_name=None: publish([event], lora_name=lora_name)
    left = drop_after

    def publish_then_drop(event, lora_name=None) -> None:
        nonlocal left
        if left > 0:
            left -= 1
            publish([event], lora_name=lora_name)

    return publish_then_drop


class SimulatedEngines:
    """The mocker as an engine kind for the worker host: every simulated worker's engines."""

    def __init__(self, cfg: MockerConfig):
        self.cfg = cfg
        self.built: list[WorkerEngines] = []
        self.instance_ids = [uuid.uuid4().hex[:16] for _ in range(cfg.num_workers)]
        self.workers: list[SimulatedWorker] = []
        self._tasks: list[asyncio.Task] = []
        self._gc_pacing: asyncio.Task | None = None

    async def build(self, *, checkpoint: bool) -> None:
        cfg, info = self.cfg, self.cfg.model_info
        building = time.monotonic()
        if cfg.startup_time > 0:
            # As a real engine loading its model: nothing is registered until this is over.
            log.info("simulating engine start-up: %.1fs", cfg.startup_time)
            await asyncio.sleep(cfg.startup_time)
        sampler = TokenSampler(info.vocab_size, info.eos_token_ids, info.special_token_ids, cfg.natural_output_len,
                               info.word_token_ids, reply_token_ids(cfg))
        self.built = [WorkerEngines(cfg, sampler) for _ in range(cfg.num_workers)]
        for engines in self.built:  # the build, as a real engine's model load (with --startup-time)
            engines.build_seconds = time.monotonic() - building
        self._tasks = [asyncio.create_task(e.run()) for w in self.built for e in w.engines]

    def checkpoint_refusal(self) -> str | None:
        return None

    async def quiesce(self) -> None:
        for engines in self.built:
            await engines.sleep(1)

    async def resume(self) -> None:
        for engines in self.built:
            await engines.wake_up()

    def restore_identity(self, identity: RestoredIdentity) -> None:
        changes = {k: v for k, v in (("namespace", identity.namespace), ("component", identity.component)) if v}
        if changes:
            self.cfg = replace(self.cfg, **changes)
        if identity.instance_id:  # several workers: the id, then -1, -2, ...
            self.instance_ids = [identity.instance_id if i == 0 else f"{identity.instance_id}-{i}"
                                 for i in range(self.cfg.num_workers)]

    async def start(self, plane: WorkerEventPlane, health: Health) -> list[Instance]:
        # One event plane for all the workers here (nats: one connection).
        self.workers = [SimulatedWorker(self.cfg, engines, health, plane, instance_id)
                        for engines, instance_id in zip(self.built, self.instance_ids)]
        return [Instance(w.server, w.card, sleep=w, lora=w, metrics=w.metrics) for w in self.workers]

    async def canary(self) -> str | None:
        for reason in await asyncio.gather(*(w.canary() for w in self.workers)):
            if reason:
                return reason
        return None

    def failure(self) -> str | None:
        return None  # a crashed simulated engine ends the process (died)

    async def died(self) -> str:
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        task = done.pop()
        return f"a simulated engine stopped: {task.exception()!r}"

    def refresh_gauges(self) -> None:
        for w in self.workers:
            w.refresh_gauges()

    def serving(self) -> None:
        log.info("%d simulated worker(s) serving %r", len(self.workers), self.cfg.served_model_name)
        # The collector's automatic passes would stall every simulated worker's step at
        # once, several times a second, and find nothing (gc_pacing.py). (The host froze the
        # start-up heap already.)
        if self.cfg.gc_interval > 0:
            self._gc_pacing = pace_garbage_collection(self.cfg.gc_interval)

    async def close(self) -> None:
        if self._gc_pacing is not None:
            self._gc_pacing.cancel()
        for task in self._tasks:
            task.cancel()
        for w in self.workers:
            w.close()


def main(argv: list[str] | None = None) -> int:
    setup_logging(argv, "python -m turbine.mocker")
    cfg = parse_mocker_args(argv)
    setup_tracing(argv, "turbine-mocker")
    return run_host(WorkerHost(cfg, SimulatedEngines(cfg)).run)


def reply_token_ids(cfg: MockerConfig) -> list[int]:
    """--reply-text as the model's tokens (none: random words)."""
    if not cfg.reply_text:
        return []
    from pathlib import Path

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(cfg.tokenizer_path) / "tokenizer.json"))
    return tokenizer.encode(cfg.reply_text, add_special_tokens=False).ids

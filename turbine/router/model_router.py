"""One model's KV routing, whichever process hosts it (the frontend, or the standalone router
service): the decision (KvRouter), the index kept in step with the workers' KV events, their
load reports (both received through one event-plane subscriber), the watchdog that says loudly
when expected events do not come, and the router's metrics."""

from __future__ import annotations

import asyncio
import random
import time

from turbine.protocol.discovery import ModelCard
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.router.config import KvRouterConfig
from turbine.router.event_watchdog import EventWatchdog
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_events_consumer import KvEventsConsumer
from turbine.router.kv_router import Decision, KvRouter
from turbine.router.load_consumer import LoadMetricsConsumer
from turbine.router.metrics import RouterMetrics

WATCHDOG_INTERVAL_S = 1.0


def worker_label(worker: WorkerKey) -> str:
    return worker.instance_id if worker.dp_rank == 0 else f"{worker.instance_id}/{worker.dp_rank}"


class ModelKvRouter:
    """`block_size`: the model's KV block size, from its card."""

    def __init__(self, model: str, cfg: KvRouterConfig, block_size: int, metrics: RouterMetrics | None = None,
                 rng: random.Random | None = None, clock=time.monotonic):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.metrics = metrics
        self.kv = KvRouter(cfg, block_size, rng)
        # One connection per worker for every topic it publishes; each consumer handles its topic.
        self.subscriber = RouterEventSubscriber()
        self.loads = LoadMetricsConsumer(self.kv.loads, subscriber=self.subscriber)
        self.events: KvEventsConsumer | None = None
        self.watchdog: EventWatchdog | None = None
        if isinstance(self.kv.index, KvIndexer):
            index = self.kv.index
            self.events = KvEventsConsumer(index, subscriber=self.subscriber)
            self.watchdog = EventWatchdog(model, lambda instance_id: index.events_of.get(instance_id, 0),
                                          cfg.events_deadline_s, clock=clock, on_warning=self._count_warning)
        # Updated on every decision: label children bound once (labels() is a locked lookup).
        self._per_decision = None if metrics is None else (
            metrics.decisions.labels(model), metrics.decision_seconds.labels(model), metrics.overlap.labels(model))
        self._ranks: dict[str, int] = {}  # live instance id -> its number of data-parallel ranks
        self._exported: dict[object, set[str]] = {}  # gauge -> worker labels it has series for
        self._counted: dict[object, int] = {}  # counter -> the tally it was last advanced to
        self._watch_task: asyncio.Task | None = None

    # -- requests ---------------------------------------------------------------------
    def decide(self, request_id: str, token_ids: list[int], instance_ids: list[str],
               lora_name: str | None = None, track: bool = True, media_keys: list[int] | None = None) -> Decision:
        """The worker (instance and data-parallel rank) among `instance_ids` for this prompt: every
        rank of each instance is a candidate of its own, since each engine has its own cache and load.
        `media_keys`: each full block's media key (hashing.media_block_keys), None: none."""
        decision = self.kv.decide(request_id, token_ids, self.workers(instance_ids), lora_name, track,
                                  media_keys=media_keys)
        if self._per_decision is not None:
            decisions, seconds, overlap = self._per_decision
            decisions.inc()
            seconds.observe(decision.seconds)
            overlap.observe(decision.overlap_ratio)
            if decision.lora_active is not None:
                self.metrics.lora_decisions.labels(self.model, "true" if decision.lora_active else "false").inc()
        if track and self.watchdog is not None and decision.overlap_blocks < decision.prompt_blocks:
            # New full blocks for that worker: it must publish BlockStored for them.
            self.watchdog.expect(request_id, decision.worker.instance_id)
        return decision

    def first_token(self, request_id: str) -> None:
        self.kv.first_token(request_id)
        if self.watchdog is not None:
            self.watchdog.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.kv.finished(request_id)
        if self.watchdog is not None:
            self.watchdog.finished(request_id)

    def workers(self, instance_ids) -> list[WorkerKey]:
        """Every rank of these instances (an instance whose card we have not seen yet: rank 0)."""
        ranks = self._ranks
        return [WorkerKey(i, r) for i in instance_ids for r in range(ranks.get(i, 1))]

    # -- fleet ------------------------------------------------------------------------
    def instances_changed(self, cards: dict[str, ModelCard], addresses: dict[str, str] | None = None) -> None:
        """The model's live instances now (instance id -> card, and -> request-plane address, where
        missed KV events are recovered from); call on every discovery change."""
        for gone in self._ranks.keys() - cards.keys():
            self.kv.instance_left(gone)
        self._ranks = {i: max(1, c.data_parallel_size) for i, c in cards.items()}
        if isinstance(self.kv.index, KvIndexer):
            self.kv.index.set_shared_tiers({i: c.kv_shared_tier for i, c in cards.items()})
        self.loads.sync(cards)
        if self.events is not None:
            self.events.sync(cards, addresses)
            # Only workers whose events the index takes (same block size) are expected to send them.
            self.watchdog.follow({i: c.kv_events_address for i, c in cards.items()
                                  if c.kv_events_address is not None and c.kv_block_size == self.block_size
                                  and c.disaggregation_mode != "decode"})
            if self._watch_task is None:
                self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.watchdog.check()

    def _count_warning(self, instance_id: str, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.event_warnings.labels(self.model, instance_id, kind).inc()

    # -- metrics ----------------------------------------------------------------------
    def export_metrics(self) -> None:
        """Copy the router's state into its gauges (at scrape time)."""
        m, model = self.metrics, self.model
        if m is None:
            return
        if self.watchdog is not None:
            self.watchdog.check()
        index = self.kv.index
        if isinstance(index, KvIndexer):
            self._set(m.indexed_blocks, {worker_label(w): index.blocks_of(w) for w in self.workers(self._ranks)})
            self._advance(m.events, index.events_applied)
        if self.events is not None:
            self._advance(m.event_gaps, self.events.gaps)
            self._advance(m.event_recoveries, self.events.recoveries)
            self._advance(m.event_recovery_failures, self.events.recovery_failures)
        loads = self.kv.loads
        reports = {worker_label(w): loads.reported(w) for w in loads.reporting_workers()}
        self._set(m.worker_active_blocks, {w: r.kv_active_blocks for w, r in reports.items()})
        self._set(m.worker_total_blocks, {w: r.kv_total_blocks for w, r in reports.items()})
        self._set(m.worker_waiting, {w: r.num_waiting for w, r in reports.items()})
        self._set(m.worker_running, {w: r.num_running for w, r in reports.items()})
        self._set(m.worker_pending_blocks, {worker_label(w): loads.pending(w).active_blocks
                                            for w in self.workers(self._ranks)})
        self._advance(m.load_reports, self.loads.received)

    def _advance(self, counter, count: int) -> None:
        """Add to the model's counter what `count` (this router's own tally) gained since the last
        scrape: the counter keeps rising across routers of one model (one gone, a new one made)."""
        last = self._counted.get(counter, 0)
        if count > last:
            counter.labels(self.model).inc(count - last)
        self._counted[counter] = count

    def _set(self, gauge, values: dict[str, float]) -> None:
        """Set one per-worker series per entry and drop the series of workers no longer there."""
        exported = self._exported.get(gauge, set())
        for gone in exported - values.keys():
            gauge.remove(self.model, gone)
        for worker, value in values.items():
            gauge.labels(self.model, worker).set(value)
        self._exported[gauge] = set(values)

    def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        self.loads.close()
        if self.events is not None:
            self.events.close()
        self.subscriber.close()

"""Keeps a KV indexer in step with the KV events of a model's workers.

Missed events are recovered, not just reported. Each publisher (worker, dp rank) numbers its
batches; on a gap, and when the router starts following a worker (it may have cached blocks
already), the consumer asks the worker's `kv_events_replay` endpoint for what it lacks: the
missed batches, or a snapshot of the worker's whole cache. Live batches arriving meanwhile are
held, then those newer than the answer are applied. When the event plane's connection to a
worker comes back after a break (a NATS restart), the consumer asks at once for what followed
the last event it applied: an idle worker would show the gap only at its next event.

Failures are loud, never silent: a worker that publishes no events, a block size that differs
from the router's, missed events and failed recoveries (retried with backoff) each log a
warning naming the worker, and are counted.

Batches come from the router's event-plane subscriber (router/event_subscriber.py), shared with
the load-metrics consumer: this consumer says which workers' events it follows and handles the
KV-events topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from turbine.protocol.discovery import ModelCard
from turbine.protocol.kv_events import WIRE_VERSION, KvEventBatch
from turbine.router.event_subscriber import RouterEventSubscriber
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_recovery import Recovered, fetch_missed
from turbine.runtime.codec import decode
from turbine.runtime.errors import DecodeError
from turbine.runtime.event_plane import KV_EVENTS_TOPIC
from turbine.runtime.request_plane import RequestPlaneClient, new_client

log = logging.getLogger("turbine.router")

RECOVERY_TIMEOUT_S = 10.0
SUBSCRIBE_WAIT_S = 5.0  # before the first recovery, for the subscription to the worker's events
RETRY_S = (0.5, 10.0)  # backoff between recovery attempts: first, longest
MAX_HELD = 100_000  # live batches held per publisher while recovering; older ones give way (a new gap)


class KvEventsConsumer:
    def __init__(self, index: KvIndexer, client: RequestPlaneClient | None = None,
                 retry_s: tuple[float, float] = RETRY_S, timeout_s: float = RECOVERY_TIMEOUT_S,
                 subscriber: RouterEventSubscriber | None = None):
        """`subscriber`: the router's event-plane subscriber, shared with its other consumers
        (default: one of its own, closed with this consumer)."""
        self.index = index
        self._own_sub = subscriber is None
        self._sub = subscriber or RouterEventSubscriber()
        self._sub.on(KV_EVENTS_TOPIC, self.handle)
        self._sub.on_resubscribed(self.resubscribed)
        self._own_client = client is None
        self._client = client or new_client()
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._address_of: dict[str, str] = {}  # instance id -> its publisher's address
        self._replay_address: dict[str, str] = {}  # instance id -> its request-plane address
        self._ranks: dict[str, int] = {}  # instance id -> its data-parallel ranks (its card's)
        self._last_event_id: dict[WorkerKey, int] = {}
        self._held: dict[WorkerKey, deque[KvEventBatch]] = {}  # publishers being recovered
        self._recovering: dict[WorkerKey, asyncio.Task] = {}
        self._warned: set[tuple[str, str]] = set()
        self.gaps = 0
        self.rejected = 0
        self.recoveries = 0
        self.recovery_failures = 0

    def sync(self, cards: dict[str, ModelCard], addresses: dict[str, str] | None = None) -> None:
        """Follow exactly the publishers of these instances (call on every discovery change).
        `addresses`: their request-plane addresses, where missed events are recovered from."""
        addresses = addresses or {}
        for instance_id in self._address_of.keys() - cards.keys():
            self._sub.unfollow(self._address_of.pop(instance_id))
            self._replay_address.pop(instance_id, None)
            self._ranks.pop(instance_id, None)
            for key in {k for k in (*self._last_event_id, *self._held) if k.instance_id == instance_id}:
                self._last_event_id.pop(key, None)
                self._stop_recovery(key)
            self.index.remove_instance(instance_id)  # every rank's blocks
        for instance_id, card in cards.items():
            if card.disaggregation_mode == "decode":
                continue  # decode workers get KV handed to them: routed by load, they publish no KV events
            if card.kv_events_address is None:
                self._warn_once(instance_id, "no-events",
                                f"worker {instance_id} publishes no KV events: the kv router cannot see its "
                                "cache (run the frontend with --no-router-kv-events for approximate routing)")
            elif card.kv_block_size != self.index.block_size:
                self._warn_once(instance_id, "block-size",
                                f"worker {instance_id} uses KV block size {card.kv_block_size} but the router "
                                f"{self.index.block_size}: its cache is ignored")
            elif instance_id not in self._address_of:
                try:
                    self._sub.follow(card.kv_events_address)
                except ValueError as exc:  # e.g. a scheme we do not know
                    self._warn_once(instance_id, "bad-address", f"worker {instance_id}: {exc}; its KV events "
                                    "are not followed")
                    continue
                self._address_of[instance_id] = card.kv_events_address
                self._ranks[instance_id] = max(1, card.data_parallel_size)
                if instance_id in addresses:
                    self._replay_address[instance_id] = addresses[instance_id]
                # It may have cached blocks already, in any of its ranks: learn them now (once
                # subscribed, so that nothing falls between the answer and the live events), not
                # at its next event.
                for rank in range(max(1, card.data_parallel_size)):
                    self._start_recovery(WorkerKey(instance_id, rank), -1,
                                         subscribed=self._sub.subscribed(card.kv_events_address))

    def handle(self, payload: bytes) -> None:
        """One message of the KV-events topic, as received."""
        try:
            batch = decode(payload, KvEventBatch)
        except DecodeError as exc:
            self.rejected += 1
            log.warning("undecodable KV event batch dropped (a worker of another wire version, wire "
                        "version here %d?): %s", WIRE_VERSION, exc)
            return
        self.apply(batch)

    def apply(self, batch: KvEventBatch) -> None:
        """One live batch, as published."""
        if batch.instance_id not in self._address_of:
            return  # a worker we no longer follow
        if not 0 <= batch.dp_rank < self._ranks.get(batch.instance_id, 1):
            # A rank its card does not have: each made-up rank would get its own index slot and
            # recovery (found by fuzzing).
            self.rejected += 1
            self._warn_once(batch.instance_id, "bad-rank", f"worker {batch.instance_id}: KV events for dp rank "
                            f"{batch.dp_rank} dropped (its card has {self._ranks.get(batch.instance_id, 1)})")
            return
        worker = WorkerKey(batch.instance_id, batch.dp_rank)
        held = self._held.get(worker)
        if held is not None:  # being recovered: applied after the answer, if newer
            held.append(batch)
            return
        last = self._last_event_id.get(worker)
        if last is None:
            if batch.event_id != 0 and self._start_recovery(worker, -1, batch):
                return  # we were not there from its first event
        elif batch.event_id <= last:
            return  # already applied (by a recovery)
        elif batch.event_id != last + 1:
            self.gaps += 1
            log.warning("worker %s (dp rank %d): KV events %d..%d were missed; %s", batch.instance_id,
                        batch.dp_rank, last + 1, batch.event_id - 1,
                        "recovering them from the worker" if self._can_recover(worker) else
                        "no request-plane address is known to recover them from: its index may be stale")
            if self._start_recovery(worker, last, batch):
                return
        self._last_event_id[worker] = batch.event_id
        self._apply_events(worker, batch)

    def resubscribed(self, address: str) -> None:
        """The event plane reconnected to `address`: what its workers published meanwhile may be
        lost. Ask each for what followed its last applied event (an empty answer if nothing)."""
        for instance_id, followed in self._address_of.items():
            if followed != address:
                continue
            for worker, last in list(self._last_event_id.items()):
                if worker.instance_id == instance_id and worker not in self._held:
                    self._start_recovery(worker, last)

    def _apply_events(self, worker: WorkerKey, batch: KvEventBatch) -> None:
        for event in batch.events:
            try:
                self.index.apply(worker, event, batch.lora_name)
            except (ValueError, OverflowError) as exc:
                self.rejected += 1
                self._warn_once(batch.instance_id, "bad-event", f"KV event rejected: {exc}")

    # -- recovery ---------------------------------------------------------------------
    def _start_recovery(self, worker: WorkerKey, after_event_id: int, batch: KvEventBatch | None = None,
                        subscribed=None) -> bool:
        """Ask the worker for what follows `after_event_id` (after `subscribed`, if given),
        holding live batches until the answer (`batch`, the one that showed the gap, first).
        False if it has no address to ask."""
        address = self._replay_address.get(worker.instance_id)
        if address is None:
            if subscribed is not None:
                subscribed.close()
            self._warn_once(worker.instance_id, "no-replay",
                            f"worker {worker.instance_id}: no request-plane address known, so KV events "
                            "missed (or published before the router followed it) cannot be recovered")
            return False
        self._held[worker] = deque([batch] if batch is not None else (), maxlen=MAX_HELD)
        self._recovering[worker] = asyncio.get_running_loop().create_task(
            self._recover(worker, address, after_event_id, subscribed))
        return True

    async def _recover(self, worker: WorkerKey, address: str, after_event_id: int, subscribed=None) -> None:
        if subscribed is not None:
            try:
                async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                    await subscribed
            except TimeoutError:  # its publisher is slow or unreachable: learn its cache anyway
                log.warning("worker %s: not subscribed to its KV events after %.0fs; asking for its cache anyway",
                            worker.instance_id, SUBSCRIBE_WAIT_S)
        delay = self._retry_s[0]
        while True:
            try:
                answer = await fetch_missed(self._client, address, worker, after_event_id, self._timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable, timed out, an error reply, a bad answer: retried
                self.recovery_failures += 1
                log.warning("worker %s (dp rank %d): recovering missed KV events failed (%s: %s); its index "
                            "stays as it was, and new events are held; retrying in %.1fs",
                            worker.instance_id, worker.dp_rank, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_s[1])
                continue
            self._recovering.pop(worker, None)
            self._recovered(worker, after_event_id, answer)
            return

    def _recovered(self, worker: WorkerKey, after_event_id: int, answer: Recovered) -> None:
        if answer.snapshot:
            self.index.remove_worker(worker)
        for batch in answer.batches:
            self._apply_events(worker, batch)
        self._last_event_id[worker] = answer.event_id
        if answer.snapshot or answer.batches:  # not the empty answer of a worker we missed nothing of
            self.recoveries += 1
        if answer.snapshot:
            log.info("worker %s (dp rank %d): KV cache reloaded from its snapshot at event %d (%d blocks)",
                     worker.instance_id, worker.dp_rank, answer.event_id, self.index.blocks_of(worker))
        elif answer.batches:
            log.info("worker %s (dp rank %d): KV events %d..%d recovered", worker.instance_id, worker.dp_rank,
                     after_event_id + 1, answer.event_id)
        for batch in self._held.pop(worker, ()):
            self.apply(batch)  # older ones are skipped; a new gap starts a new recovery

    def _can_recover(self, worker: WorkerKey) -> bool:
        return worker.instance_id in self._replay_address

    def _stop_recovery(self, worker: WorkerKey) -> None:
        self._held.pop(worker, None)
        task = self._recovering.pop(worker, None)
        if task is not None:
            task.cancel()

    async def settle(self) -> None:
        """Wait until no recovery is under way (tests, orderly shutdown)."""
        while self._recovering:
            await asyncio.gather(*self._recovering.values(), return_exceptions=True)

    def _warn_once(self, instance_id: str, kind: str, message: str) -> None:
        if (instance_id, kind) not in self._warned:
            self._warned.add((instance_id, kind))
            log.warning(message)

    def close(self) -> None:
        for worker in list(self._recovering):
            self._stop_recovery(worker)
        self._sub.release(self._address_of.values(), owner=self._own_sub)
        self._address_of.clear()
        if self._own_client:
            self._own_client = False
            try:
                asyncio.get_running_loop().create_task(self._client.close())
            except RuntimeError:  # no loop any more: its sockets go with the process
                pass

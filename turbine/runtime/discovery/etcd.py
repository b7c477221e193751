"""Discovery in etcd: one lease per process, kept alive; keys attached to it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator

import grpc.aio
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end

from turbine.runtime.discovery.base import DiscoveryBackend
from turbine.runtime.discovery.endpoints import etcd_grpc_target
from turbine.runtime.errors import DiscoveryError

logger = logging.getLogger("turbine.discovery")

RECONNECT_BACKOFF_MS = (250, 1000)  # first and longest wait before reconnecting to etcd

# AioRpcError: etcd3aio re-raises non-transient gRPC errors (e.g. NOT_FOUND) unwrapped.
_ETCD_ERRORS = (EtcdError, grpc.aio.AioRpcError, TimeoutError, DiscoveryError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):  # its str() is a multi-line dump
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class EtcdDiscovery(DiscoveryBackend):
    def __init__(
        self, endpoints: list[str], ttl: float = 10, *, root: str = "turbine/", timeout: float = 5.0
    ) -> None:
        self.endpoints = list(endpoints)
        self.ttl = max(1, math.ceil(ttl))  # etcd leases have whole-second TTLs
        self.root = root
        self.timeout = timeout
        self.lease_id = 0
        # etcd3aio retries a broken watch stream itself: cap its backoff as the channel's.
        self._client = Etcd3Client(self.endpoints,
                                   watch_max_reconnect_backoff_seconds=RECONNECT_BACKOFF_MS[1] / 1000)
        # gRPC's reconnect backoff grows to 120 s by default: after a 30 s etcd outage we measured
        # the client reconnecting 13 s after etcd was back, when every lease had lapsed. Retry
        # about every second instead (one local TCP connect: cheap for etcd).
        # etcd3aio takes IPv4 addresses only; a DNS name needs gRPC's DNS resolver (endpoints.py).
        self._client._manager.target = etcd_grpc_target(self.endpoints)
        self._client._manager.grpc_options += [  # etcd3aio has no parameter for channel options
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]
        self._keys: dict[str, bytes] = {}  # what we own: re-put after a lease loss
        # After etcd lost its data: owners (same TTL, we assume) renew every ttl/3, then re-put.
        self._resync_after_s = self.ttl / 3 + 1.0
        # Serialises writes with lease replacement, so a re-put never resurrects a deleted key.
        self._lock = asyncio.Lock()
        self._stale = False  # a write failed: etcd may not hold exactly self._keys
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._client.connect()
        try:
            await self._grant()
        except _ETCD_ERRORS as exc:
            await self._client.close()
            raise DiscoveryError(f"cannot reach etcd at {','.join(self.endpoints)}: {_describe(exc)}") from exc
        self._task = asyncio.create_task(self._keepalive_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        async with self._lock:
            self._keys.clear()
            if self.lease_id:
                # Revoking deletes our keys now rather than at lease expiry.
                with contextlib.suppress(*_ETCD_ERRORS):
                    await self._client.lease.revoke(self.lease_id, timeout=self.timeout)
                self.lease_id = 0
        await self._client.close()

    async def put(self, key: str, value: bytes) -> None:
        """Raises DiscoveryError if etcd is unreachable; the key is still published once it is back."""
        async with self._lock:
            self._keys[key] = value
            try:
                try:
                    await self._client.kv.put(self.root + key, value, lease=self.lease_id, timeout=self.timeout)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    await self._replace_lease()  # lease expired before our keep-alive noticed
            except _ETCD_ERRORS as exc:
                self._stale = True
                raise DiscoveryError(f"etcd put {key!r} failed: {_describe(exc)}") from exc

    async def delete(self, key: str) -> None:
        async with self._lock:
            self._keys.pop(key, None)
            try:
                await self._client.kv.delete(self.root + key, timeout=self.timeout)
            except _ETCD_ERRORS as exc:
                self._stale = True
                raise DiscoveryError(f"etcd delete {key!r} failed: {_describe(exc)}") from exc

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        try:
            snapshot, _ = await self._range(prefix)
        except _ETCD_ERRORS as exc:
            raise DiscoveryError(f"etcd get {prefix!r} failed: {_describe(exc)}") from exc
        return snapshot

    async def watch_prefix(self, prefix: str) -> AsyncIterator[dict[str, bytes]]:
        full = self.root + prefix
        last: dict[str, bytes] | None = None
        while True:
            data_lost = False
            try:
                # Snapshot, then watch from the next revision: no event can fall in between.
                snapshot, revision = await self._range(prefix)
                if snapshot != last:
                    last = dict(snapshot)
                    yield dict(snapshot)
                watch = self._client.watch.watch(full, prefix_range_end(full), start_revision=revision + 1)
                async with contextlib.aclosing(watch):
                    async for response in watch:
                        if response.canceled or response.compact_revision:
                            break  # history compacted or watch dropped: re-read the snapshot
                        if response.header.revision < revision:
                            data_lost = True  # etcd restarted without its data: our revision never comes
                            break
                        revision = response.header.revision
                        for event in response.events:
                            key = event.kv.key.decode()[len(self.root) :]
                            if event.type == event.DELETE:
                                snapshot.pop(key, None)
                            else:
                                snapshot[key] = event.kv.value
                        if snapshot != last:
                            last = dict(snapshot)
                            yield dict(snapshot)
                if data_lost:
                    # Every key is gone until its owner finds its lease unknown (at its next
                    # keep-alive) and puts its keys again: re-read after that, so that callers
                    # never see live workers vanish (the frontend would drop its model table).
                    logger.warning("etcd restarted without its data; re-reading %r in %.1fs, once owners "
                                   "have registered again", full, self._resync_after_s)
                    await asyncio.sleep(self._resync_after_s)
            except _ETCD_ERRORS as exc:
                logger.warning("etcd watch on %r failed (%s); retrying", full, _describe(exc))
                await asyncio.sleep(1.0)
            except Exception:  # the caller keeps its last snapshot meanwhile; never stop watching
                logger.exception("etcd watch on %r failed unexpectedly; retrying", full)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------ internals

    async def _range(self, prefix: str) -> tuple[dict[str, bytes], int]:
        full = self.root + prefix
        resp = await self._client.kv.get(full, prefix_range_end(full), timeout=self.timeout)
        cut = len(self.root)
        return {kv.key.decode()[cut:]: kv.value for kv in resp.kvs}, resp.header.revision

    async def _grant(self) -> None:
        lease = await self._client.lease.grant(self.ttl, timeout=self.timeout)
        self.lease_id = lease.ID

    async def _keepalive_loop(self) -> None:
        interval = self.ttl / 3
        healthy = True
        while True:
            # Retry sooner while etcd is unreachable so we re-register soon after it is back.
            await asyncio.sleep(interval if healthy else min(interval, 0.5))
            try:
                alive = await self._renew()
                async with self._lock:
                    if not alive:
                        logger.warning(
                            "etcd lease %x expired while this process was alive; re-registering %d key(s)",
                            self.lease_id,
                            len(self._keys),
                        )
                        await self._replace_lease()
                    elif self._stale:
                        await self._republish()
                if not healthy:
                    logger.warning("etcd reachable again; lease %x is live", self.lease_id)
                healthy = True
            except _ETCD_ERRORS as exc:
                if healthy:
                    logger.warning("etcd lease keep-alive failed (%s); will retry and re-register", _describe(exc))
                healthy = False
                self._stale = True
            except Exception:  # whatever it is, a live process must never stop renewing for good
                if healthy:
                    logger.exception("etcd lease keep-alive failed unexpectedly; will retry and re-register")
                healthy = False
                self._stale = True

    async def _renew(self) -> bool:
        """One keep-alive round trip; False if etcd says the lease no longer exists."""
        call = self._client.lease.keep_alive(self.lease_id)
        try:
            async with asyncio.timeout(self.timeout):
                async for reply in call:
                    return reply.TTL > 0
        finally:
            call.cancel()
        raise DiscoveryError("etcd closed the keep-alive stream without a reply")

    async def _replace_lease(self) -> None:
        """Caller holds the lock. Our old lease (and its keys) is gone: start over."""
        await self._grant()
        self._stale = True
        await self._republish()

    async def _republish(self) -> None:
        """Caller holds the lock. Make etcd hold exactly our keys under the current lease."""
        attached = await self._client.lease.time_to_live(self.lease_id, keys=True, timeout=self.timeout)
        cut = len(self.root)
        for raw in attached.keys:
            key = raw.decode()[cut:]
            if key not in self._keys:  # a delete that failed while etcd was unreachable
                await self._client.kv.delete(raw, timeout=self.timeout)
        for key, value in self._keys.items():
            await self._client.kv.put(self.root + key, value, lease=self.lease_id, timeout=self.timeout)
        self._stale = False

"""Where stored responses and conversations live: a small key-value store with revisions, in this
process (`MemoryKv`: bounded by count and bytes, least recently used first out, a TTL) or shared by
every frontend on NATS JetStream's key-value store (`NatsKv`: one bucket, its TTL, size bound and
largest value set when the bucket is made).

Why NATS JetStream KV rather than etcd: the values are whole responses and conversations (up to a
megabyte), written once per request and expiring after days. JetStream KV has a per-bucket TTL
(`max_age`), a byte bound (`max_bytes`; the bucket is set to drop its oldest writes when full) and a
per-value bound, and it stores on disk
(file storage), so restarting the server keeps them. etcd is made for small metadata: 1.5 MiB per
request, a whole-database quota (2 GiB by default) that stops every write when reached, no TTL
except through leases (one per key or per group), and every write kept as a revision until a
compaction; the frontends' discovery would share its quota with the responses. NATS already runs
where the event plane does (`--event-plane nats`).

Values are bytes (msgspec JSON of typed records, turbine/frontend/apis/stored_responses.py): nothing read
here is ever unpickled. Any failure to reach the store is `StoreUnavailable` (HTTP 503), never an
empty answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from turbine.config import check, flag
from turbine.frontend.errors import RequestError

log = logging.getLogger("turbine.frontend")

STORE_KINDS = ("auto", "memory", "nats", "off")
DEFAULT_TTL_S = 30 * 24 * 3600  # as OpenAI keeps responses: 30 days
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_RECORD_BYTES = 1 << 20  # NATS's default max_payload; the NATS store takes the server's if smaller
NATS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StoreConfig:
    """`kind`: auto (memory for one frontend process, off for several: their own memories would
    not find each other's responses), memory, nats (shared by every frontend), off (stateless:
    `store` defaults to false and `store: true`, `previous_response_id`, `background` and
    conversations are refused)."""

    kind: str = flag("--response-store", default="auto")
    nats_url: str = flag("--response-store-nats-url", default="nats://127.0.0.1:4222")
    bucket: str = flag("--response-store-bucket", default="turbine-responses")
    ttl_s: float = flag("--response-store-ttl", default=DEFAULT_TTL_S)
    max_bytes: int = flag("--response-store-max-bytes", default=DEFAULT_MAX_BYTES)
    max_entries: int = flag("--response-store-max-entries", default=DEFAULT_MAX_ENTRIES)
    max_record_bytes: int = flag("--response-store-max-record-bytes", default=DEFAULT_MAX_RECORD_BYTES)

    def __post_init__(self):
        check(self, self.kind in STORE_KINDS, "kind", f"choose from {', '.join(STORE_KINDS)}")
        check(self, self.ttl_s > 0, "ttl_s", "must be > 0 (seconds)")
        check(self, self.max_entries >= 1, "max_entries", "must be >= 1")
        check(self, self.max_record_bytes >= 1024, "max_record_bytes", "must be >= 1024")
        check(self, self.max_bytes >= self.max_record_bytes, "max_bytes",
              "must be at least --response-store-max-record-bytes")
        check(self, self.kind != "nats" or self.nats_url.startswith(("nats://", "tls://")), "nats_url",
              "expected nats://HOST:PORT")
        check(self, bool(self.bucket) and all(c.isalnum() or c in "-_" for c in self.bucket), "bucket",
              "letters, digits, '-' and '_' only")

    def resolved(self, processes: int) -> StoreConfig:
        """`auto` made concrete for a frontend of `processes` processes; memory with several is refused."""
        check(self, self.kind != "memory" or processes == 1, "kind",
              "memory keeps responses in each process; with --frontend-processes > 1 a follow-up would not "
              "find its parent on another process: use --response-store nats (shared) or off")
        if self.kind != "auto":
            return self
        import dataclasses

        return dataclasses.replace(self, kind="memory" if processes == 1 else "off")


class StoreUnavailable(RequestError):
    """The store cannot be reached: 503, so that a client retries, never an empty context."""

    def __init__(self, message: str):
        super().__init__(f"the response store is unavailable: {message}", status=503,
                         type_="service_unavailable", code="store_unavailable")


class Conflict(Exception):
    """A compare-and-set lost: the key changed (or exists, or is gone) since it was read."""


class Kv(Protocol):
    async def get(self, key: str) -> tuple[bytes, int] | None: ...  # (value, revision)

    async def put(self, key: str, value: bytes) -> int: ...

    async def create(self, key: str, value: bytes) -> int: ...  # Conflict if it exists

    async def update(self, key: str, value: bytes, revision: int) -> int: ...  # Conflict if changed

    async def delete(self, key: str) -> None: ...

    async def ready(self) -> None: ...  # StoreUnavailable when it cannot be reached

    async def close(self) -> None: ...


class MemoryKv:
    """This process's store: least recently used out past `max_entries` or `max_bytes`, and
    entries older than `ttl_s` out when next looked at."""

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self.max_record_bytes = cfg.max_record_bytes
        self._items: OrderedDict[str, tuple[bytes, int, float]] = OrderedDict()
        self._bytes = 0
        self._revision = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    async def get(self, key: str) -> tuple[bytes, int] | None:
        item = self._items.get(key)
        if item is None:
            return None
        value, revision, written = item
        if time.monotonic() - written > self.cfg.ttl_s:
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return value, revision

    async def put(self, key: str, value: bytes) -> int:
        self._drop(key)
        self._revision += 1
        self._items[key] = (value, self._revision, time.monotonic())
        self._bytes += len(value)
        while len(self._items) > self.cfg.max_entries or self._bytes > self.cfg.max_bytes:
            self._drop(next(iter(self._items)))
        return self._revision

    async def create(self, key: str, value: bytes) -> int:
        if await self.get(key) is not None:
            raise Conflict(key)
        return await self.put(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        current = await self.get(key)
        if current is None or current[1] != revision:
            raise Conflict(key)
        return await self.put(key, value)

    async def delete(self, key: str) -> None:
        self._drop(key)

    async def ready(self) -> None:
        return None

    async def close(self) -> None:
        self._items.clear()

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= len(item[0])


class NatsKv:
    """A JetStream key-value bucket shared by every frontend. Connects on first use (and again
    after a failure); nats-py reconnects by itself after an outage. An operation that cannot
    complete within NATS_TIMEOUT_S raises StoreUnavailable."""

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self.max_record_bytes = cfg.max_record_bytes
        self._nc = None
        self._kv = None
        self._lock = asyncio.Lock()

    async def _bucket(self):
        if self._kv is not None and self._nc is not None and self._nc.is_connected:
            return self._kv
        if self._nc is not None and not self._nc.is_closed:
            raise StoreUnavailable(f"not connected to NATS at {self.cfg.nats_url} (reconnecting)")
        async with self._lock:
            if self._kv is None or self._nc is None or self._nc.is_closed:
                await self._connect()
        return self._kv

    async def _connect(self) -> None:
        from nats.aio.client import Client
        from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError

        nc = Client()
        try:
            # Reconnecting forever once connected; the first connection is bounded (nats-py would retry it
            # forever too).
            await asyncio.wait_for(nc.connect(
                self.cfg.nats_url, connect_timeout=NATS_TIMEOUT_S, allow_reconnect=True, max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, error_cb=_quiet, disconnected_cb=_disconnected,
                reconnected_cb=_reconnected), NATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (nats-py raises several kinds, and OSError)
            with contextlib.suppress(Exception):
                await nc.close()
            raise StoreUnavailable(f"cannot connect to NATS at {self.cfg.nats_url}: "
                                   f"{type(exc).__name__} {exc}".rstrip()) from None
        try:
            js = nc.jetstream(timeout=NATS_TIMEOUT_S)
            try:
                kv = await js.key_value(self.cfg.bucket)
            except BucketNotFoundError:
                kv = await js.create_key_value(KeyValueConfig(
                    bucket=self.cfg.bucket, description="Turbine: stored responses and conversations",
                    history=1, ttl=self.cfg.ttl_s, max_bytes=self.cfg.max_bytes, storage=StorageType.FILE,
                    max_value_size=min(self.cfg.max_record_bytes, nc.max_payload)))
            # A full bucket drops its oldest writes (as the memory store its least recently used), instead
            # of refusing every new one (nats-py makes key-value buckets with discard "new").
            stream = await js.stream_info(f"KV_{self.cfg.bucket}")
            if stream.config.discard != DiscardPolicy.OLD:
                stream.config.discard = DiscardPolicy.OLD
                await js.update_stream(stream.config)
        except Exception as exc:  # noqa: BLE001
            await nc.close()
            raise StoreUnavailable(f"NATS at {self.cfg.nats_url} has no JetStream key-value bucket "
                                   f"{self.cfg.bucket!r} (is JetStream on? nats-server -js): {exc}") from None
        # A record must fit in one NATS message.
        self.max_record_bytes = min(self.cfg.max_record_bytes, nc.max_payload - 4096)
        self._nc, self._kv = nc, kv

    async def _run(self, what: str, op):
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        kv = await self._bucket()
        try:
            return await asyncio.wait_for(op(kv), NATS_TIMEOUT_S)
        except (KeyNotFoundError, KeyWrongLastSequenceError, Conflict):
            raise
        except Exception as exc:  # noqa: BLE001
            if _is_wrong_sequence(exc):
                raise Conflict(what) from None
            raise StoreUnavailable(f"NATS {what}: {type(exc).__name__} {exc}".rstrip()) from None

    async def get(self, key: str) -> tuple[bytes, int] | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self._run("get", lambda kv: kv.get(key))
        except KeyNotFoundError:  # deleted and purged keys too
            return None
        return entry.value, entry.revision

    async def put(self, key: str, value: bytes) -> int:
        return await self._run("put", lambda kv: kv.put(key, value))

    async def create(self, key: str, value: bytes) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            return await self._run("create", lambda kv: kv.create(key, value))
        except KeyWrongLastSequenceError:
            raise Conflict(key) from None

    async def update(self, key: str, value: bytes, revision: int) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            return await self._run("update", lambda kv: kv.update(key, value, last=revision))
        except KeyWrongLastSequenceError:
            raise Conflict(key) from None

    async def delete(self, key: str) -> None:
        await self._run("delete", lambda kv: kv.purge(key))

    async def ready(self) -> None:
        await self._bucket()

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = self._kv = None


def _is_wrong_sequence(exc: Exception) -> bool:
    # JetStream's "wrong last sequence" (err_code 10071) as a plain APIError in some nats-py paths.
    return getattr(exc, "err_code", None) == 10071


async def _quiet(exc: Exception) -> None:
    log.debug("response store NATS connection: %s", exc)


async def _disconnected() -> None:
    log.warning("response store: disconnected from NATS; stored-response requests get 503 until it is back")


async def _reconnected() -> None:
    log.warning("response store: reconnected to NATS")


class TimedKv:
    """A store whose operations are timed into a histogram labelled by operation (`/metrics`:
    turbine_frontend_response_store_seconds)."""

    def __init__(self, kv: Kv, histogram):
        self.kv, self._by_op = kv, {op: histogram.labels(op) for op in ("get", "put", "create", "update", "delete")}

    @property
    def max_record_bytes(self) -> int:
        return self.kv.max_record_bytes

    async def _timed(self, op: str, call):
        started = time.perf_counter()
        try:
            return await call
        finally:
            self._by_op[op].observe(time.perf_counter() - started)

    async def get(self, key):
        return await self._timed("get", self.kv.get(key))

    async def put(self, key, value):
        return await self._timed("put", self.kv.put(key, value))

    async def create(self, key, value):
        return await self._timed("create", self.kv.create(key, value))

    async def update(self, key, value, revision):
        return await self._timed("update", self.kv.update(key, value, revision))

    async def delete(self, key):
        return await self._timed("delete", self.kv.delete(key))

    async def ready(self) -> None:
        await self.kv.ready()

    async def close(self) -> None:
        await self.kv.close()


def make_kv(cfg: StoreConfig, histogram=None) -> Kv | None:
    """The store for a resolved config (None: off), timed into `histogram` when given."""
    kv = MemoryKv(cfg) if cfg.kind == "memory" else NatsKv(cfg) if cfg.kind == "nats" else None
    return TimedKv(kv, histogram) if kv is not None and histogram is not None else kv

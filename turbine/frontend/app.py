"""The frontend process's state: its config, the models it serves (from discovery), the
request-plane client and the metrics. Its OpenAI-compatible ASGI app is the http stage's
(turbine/frontend/http/api.py, `asgi_app(frontend)`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from turbine.config import ClusterSecurityConfig, DiscoveryConfig, RequestPlaneConfig, check, flag, make_registry
from turbine.frontend.apis.response_routes import BackgroundRuns
from turbine.frontend.apis.state_store import StoreConfig, make_kv
from turbine.frontend.apis.stored_responses import Records
from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.dispatch.migration import MigrationConfig
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.models.busy_queue import BusyConfig
from turbine.frontend.models.pools import PooledDiscovery, PoolConfig, PoolRouter, check_pools
from turbine.frontend.models.table import ModelTable
from turbine.frontend.preprocess.media import MediaConfig
from turbine.frontend.preprocess.prompt_embeds import DEFAULT_MAX_PROMPT_EMBEDS_BYTES, MAX_PROMPT_EMBEDS_BYTES
from turbine.router.policy import RouterConfig, make_router
from turbine.runtime.gc_pacing import freeze_start_up_heap
from turbine.runtime import cluster_auth, prometheus_multiprocess

log = logging.getLogger(__name__)

MIN_REQUEST_BYTES = 1024
# With several frontend processes a scrape reads every process's metric files, but a router's counts are
# brought up to date only when they are exported: each process exports its own this often.
ROUTER_METRICS_EXPORT_S = 1.0


# Far above what one frontend process streams at speed (docs/benchmarks/frontend.md, frontend ceiling),
# so it bites only on a flood.
DEFAULT_MAX_INFLIGHT_REQUESTS = 4096
MAX_PROCESSES = 256  # --frontend-processes
FIRST_SNAPSHOT_WAIT_S = 5.0


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = flag("--http-host", default="127.0.0.1")
    http_port: int = flag("--http-port", default=8000)
    router: RouterConfig = RouterConfig()
    namespace: str | None = flag("--namespace", default=None)  # serve models of this namespace only; None = all
    # One key, or several separated by commas: each client key sees only its own stored responses.
    api_key: str | None = flag("--api-key", default=None)
    max_request_bytes: int = flag("--max-request-bytes", default=8 << 20)
    # Decoded size of a /v1/completions prompt_embeds tensor file (it also counts in the body).
    max_prompt_embeds_bytes: int = flag("--max-prompt-embeds-bytes", default=DEFAULT_MAX_PROMPT_EMBEDS_BYTES)
    discovery: DiscoveryConfig = DiscoveryConfig()
    media: MediaConfig = MediaConfig()  # images in chats: fetch and decode bounds, private addresses
    disagg: DisaggConfig = DisaggConfig()
    migration: MigrationConfig = MigrationConfig()
    # Unknown request fields are dropped (a warning per field name) instead of answered with a 400.
    ignore_unknown_fields: bool = flag("--ignore-unknown-fields", default=False)
    # How it proves itself to workers and routers, and checks their events.
    security: ClusterSecurityConfig = ClusterSecurityConfig()
    # How it reaches workers: tcp or nats (workers registered on the other plane are not routed to).
    request_plane: RequestPlaneConfig = RequestPlaneConfig()
    # Overload control: generation requests held at once (more get 503), and the Retry-After
    # (seconds) of every 503 'overloaded' answer.
    max_inflight_requests: int = flag("--max-inflight-requests", default=DEFAULT_MAX_INFLIGHT_REQUESTS)
    overload_retry_after: int = flag("--overload-retry-after", default=1)
    # Busy thresholds per worker and the queue of requests waiting while every worker is over them.
    busy: BusyConfig = BusyConfig()
    # Processes serving the one HTTP port (SO_REUSEPORT: the kernel spreads connections over them).
    # Each is a whole frontend (its own discovery watch, router, counters, in-flight limit).
    processes: int = flag("--frontend-processes", default=1)
    # One INFO line per HTTP request on the logger turbine.access (method, path, status, duration).
    access_log: bool = flag("--access-log", default=True)
    # Stored responses and conversations (/v1/responses with store, /v1/conversations).
    store: StoreConfig = StoreConfig()
    # The global router (pools.py): the deployments it routes over; empty: this frontend's discovery alone.
    pools: tuple[PoolConfig, ...] = flag("--pool", default=())

    def __post_init__(self):
        check(self, 0 <= self.http_port <= 65535, "http_port", "must be between 0 and 65535")
        check(self, self.max_request_bytes >= MIN_REQUEST_BYTES, "max_request_bytes",
              f"must be at least {MIN_REQUEST_BYTES}")
        check(self, 1 <= self.max_prompt_embeds_bytes <= MAX_PROMPT_EMBEDS_BYTES, "max_prompt_embeds_bytes",
              f"must be between 1 and {MAX_PROMPT_EMBEDS_BYTES} (a request-plane frame holds 32 MiB)")
        check(self, self.api_key is None or all(k.strip() for k in self.api_key.split(",")), "api_key",
              "is empty (or has an empty key between commas)")
        check(self, self.max_inflight_requests >= 1, "max_inflight_requests", "must be >= 1")
        check(self, self.overload_retry_after >= 0, "overload_retry_after", "must be >= 0 (seconds)")
        check(self, 1 <= self.processes <= MAX_PROCESSES, "processes", f"must be between 1 and {MAX_PROCESSES}")
        check(self, self.processes == 1 or self.http_port != 0, "processes",
              "several processes need a fixed --http-port (0 would give each its own port)")
        object.__setattr__(self, "store", self.store.resolved(self.processes))
        self.request_plane.check_security(self, self.security)
        if self.pools:
            check(self, (problem := check_pools(self.pools)) is None, "pools", problem or "")
            check(self, self.router.mode == "kv", "pools",
                  "the pools are chosen by the KV router's cost: add --router-mode kv")
            check(self, self.namespace is None, "pools", "each pool names its namespace: drop --namespace")

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.api_key.split(",")) if self.api_key is not None else ()


class Frontend:
    def __init__(self, cfg: FrontendConfig):
        self.cfg = cfg
        auth = cfg.security.auth()
        cluster_auth.install(auth)  # the routers' event subscribers take it from there
        cfg.request_plane.install()  # and their clients (missed KV events) this
        self.metrics = FrontendMetrics()
        self.registry = make_registry(cfg.discovery)
        self.pooled = PooledDiscovery(cfg.pools, cfg.discovery, self.registry) if cfg.pools else None
        self.models = ModelTable(self.pooled or self.registry, self._router_for, cfg.namespace, cfg.busy,
                                 cfg.request_plane)
        self.client = cfg.request_plane.client(auth=auth)
        self.kv = make_kv(cfg.store, self.metrics.response_store)
        self.records = Records(self.kv) if self.kv is not None else None
        self.background = BackgroundRuns()
        self._watch_task = None

    def _router_for(self, card):
        router = make_router(self.cfg.router, card, self.metrics.router)
        if self.pooled is None:
            return router
        return PoolRouter(router, self.pooled.pool_of, tuple(p.name for p in self.cfg.pools), card.name, self.metrics)

    def export_router_metrics(self) -> None:
        """Bring the routers' metrics up to date (they count in their own structures)."""
        for model in self.models.models.values():
            model.router.export_metrics()
            if model.prefill_router is not None:
                model.prefill_router.export_metrics()

    async def _export_router_metrics(self) -> None:
        while True:
            await asyncio.sleep(ROUTER_METRICS_EXPORT_S)
            self.export_router_metrics()

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await self.registry.backend.start()
        if self.pooled is not None:
            await self.pooled.start()
        self._watch_task = asyncio.create_task(self.models.run())
        # Serve no request before the first discovery snapshot: with --frontend-processes N a process
        # that accepted earlier would answer 404 for a model its siblings serve. Discovery that is down
        # must not keep the frontend from starting (it answers 503 then), hence the bound.
        try:
            await asyncio.wait_for(self.models.first_snapshot.wait(), FIRST_SNAPSHOT_WAIT_S)
        except TimeoutError:
            log.warning("no discovery snapshot within %.0f s: serving without one", FIRST_SNAPSHOT_WAIT_S)
        freeze_start_up_heap()  # what start-up built lives as long as the process: out of later collector passes
        exporter = (asyncio.create_task(self._export_router_metrics()) if prometheus_multiprocess.enabled()
                    else None)
        try:
            yield
        finally:
            if exporter is not None:
                exporter.cancel()
            self._watch_task.cancel()
            await self.background.close()
            if self.kv is not None:
                await self.kv.close()
            await self.client.close()
            if self.pooled is not None:
                await self.pooled.close()
            await self.registry.backend.close()

"""The planner process (`turbine planner`, `python -m turbine.planner`): follows discovery for
the workers it plans and the frontend's metrics for traffic, decides (planner.py) and hands each
decision to its connector.

Start-up: status server (`/live`, `/health`: "starting" until the frontend answers and a worker of
every planned role whose minimum is above 0 is visible, `/metrics`) -> register in discovery
(component "planner", endpoint "status", its address the status server's) -> the connector's
start -> each role brought up to its minimum (ready + starting; decision "startup", not in advisory
mode), so the planner can start an empty fleet -> wait for the frontend and the workers -> the loop: every fast interval the load
path, every adjustment interval the throughput path; a decision that changes a target gets the
next decision id and goes to the connector (`--advisory`: logged only). SIGTERM/SIGINT: stop,
unregister, close the connector."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import httpx

from turbine.planner.config import PlannerConfig
from turbine.planner.connector import AdvisoryConnector, Connector, make_connector
from turbine.planner.load_reports import LoadReports
from turbine.planner.observe import FrontendScraper, PrometheusSource
from turbine.planner.planner import Planner
from turbine.planner.profile import PerformanceModel, load_engine_profile
from turbine.protocol.discovery import InstanceRecord, ModelCard

log = logging.getLogger("turbine.planner")

PLANNER_COMPONENT = "planner"
STATUS_ENDPOINT = "status"


class PlannerService:
    def __init__(self, cfg: PlannerConfig, connector: Connector | None = None):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.planner = Planner(cfg, PerformanceModel(load_engine_profile(cfg.profile), where=cfg.profile))
        self.metrics = self.planner.metrics
        self.connector = connector or make_connector(cfg.connector, cfg)
        self.source = (PrometheusSource(cfg.prometheus_url, cfg.model) if cfg.prometheus_url
                       else FrontendScraper(cfg.frontend_url, cfg.model))
        self.loads = LoadReports()
        self.visible: dict[str, int] = {}  # role -> workers in discovery
        self.decision_id = 0
        self._starting_since: dict[str, tuple[float, int]] = {}  # role -> (since when starting, ready then)
        self._asleep_seen: int | None = None  # the frontend's model_asleep answers at the last look
        self.status = "starting"
        self.address: str | None = None

    # -- discovery --------------------------------------------------------------------
    def apply(self, instances: list[InstanceRecord], cards: list[ModelCard]) -> None:
        live = {rec.path for rec in instances}
        mine: dict[str, ModelCard] = {}
        for card in cards:
            if card.namespace != self.cfg.namespace or card.path not in live:
                continue
            if card.lora_name is not None:  # a LoRA adapter's card: its instance counts by its base card
                continue
            if self.cfg.model is not None and card.name != self.cfg.model:
                continue
            if card.disaggregation_mode in self.cfg.roles:
                mine[card.instance_id] = card
        counts = dict.fromkeys(self.cfg.roles, 0)
        for card in mine.values():
            counts[card.disaggregation_mode] += 1
        if counts != self.visible:
            log.info("workers in discovery: %s", counts)
        self.visible = counts
        self.loads.sync(mine)
        if isinstance(self.connector, AdvisoryConnector):
            self.connector.observe(counts)

    async def _follow(self, registry) -> None:
        async for instances, cards in registry.watch():
            try:
                self.apply(instances, cards)
            except Exception:  # a bad card must not stop the watcher
                log.exception("could not apply a discovery snapshot")

    # -- readiness --------------------------------------------------------------------
    async def _frontend_answers(self, http: httpx.AsyncClient) -> bool:
        try:
            if self.cfg.prometheus_url:
                await self.source.start()
                return True
            return (await http.get(self.cfg.frontend_url.rstrip("/") + "/metrics")).status_code == 200
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError):
            return False

    def _missing_roles(self) -> list[str]:
        return [r for r in self.cfg.roles if self.cfg.minimum(r) > 0 and self.visible.get(r, 0) == 0]

    async def wait_until_visible(self, stopping: asyncio.Event) -> bool:
        """Until the frontend answers and every planned role has a worker; False if stopped first."""
        said = 0.0
        async with httpx.AsyncClient(timeout=5.0) as http:
            while not stopping.is_set():
                frontend = await self._frontend_answers(http)
                missing = self._missing_roles()
                if frontend and not missing:
                    return True
                if time.monotonic() - said > 10:
                    said = time.monotonic()
                    source = self.cfg.prometheus_url or self.cfg.frontend_url
                    waits = [] if frontend else [f"the frontend's metrics at {source}"]
                    waits += [f"{', '.join(missing)} workers in discovery"] if missing else []
                    log.info("waiting for %s", " and ".join(waits))
                await _wait(stopping, 0.5)
        return False

    # -- the loop ---------------------------------------------------------------------
    async def current(self) -> tuple[dict[str, int], dict[str, int]]:
        """Ready and starting workers per role (the connector's view)."""
        counts = await self.connector.current_replicas()
        starting = await self.connector.starting_replicas()
        if (sleeping := getattr(self.connector, "sleeping_replicas", None)) is not None:  # a sleeping pool
            asleep = await sleeping()
            self.planner.note_pool(asleep, self.connector.pool_capacity())
            for role in self.cfg.roles:
                self.metrics.sleeping_replicas.labels(role).set(asleep.get(role, 0))
        now = time.monotonic()
        for role in self.cfg.roles:
            ready, coming = counts.get(role, 0), starting.get(role, 0)
            self.metrics.current_replicas.labels(role).set(ready)
            self.metrics.starting_replicas.labels(role).set(coming)
            # An observed start-up: from when a role had workers starting until its ready count rose.
            since = self._starting_since.get(role)
            if since is not None and ready > since[1]:
                self.planner.note_startup(now - since[0])
                self.metrics.startup.labels(role).set(now - since[0])
                log.info("%s: a worker became ready %.1fs after it was asked for", role, now - since[0])
                since = None
                self._starting_since.pop(role)
            if since is None and coming > 0:
                self._starting_since[role] = (now, ready)
            elif since is not None and coming == 0:
                self._starting_since.pop(role)  # stopped before it was ready: no start-up to learn from
        return counts, starting

    async def bring_to_minimum(self) -> None:
        """Start what each role lacks of its minimum (ready + starting), before any worker is visible."""
        if not self.cfg.applies or isinstance(self.connector, AdvisoryConnector):
            return
        current, starting = await self.current()
        have = {r: current.get(r, 0) + starting.get(r, 0) for r in self.cfg.roles}
        targets = {r: max(have[r], min(self.cfg.minimum(r), self.cfg.maximum(r))) for r in self.cfg.roles}
        if targets != have:
            await self.decide(targets, have, "startup")

    async def decide(self, targets: dict[str, int] | None, current: dict[str, int], path: str) -> None:
        base = self.planner.targets or current
        if targets is None or all(targets.get(r) == base.get(r) for r in targets):
            return
        self.decision_id += 1
        self.metrics.decision_id.set(self.decision_id)
        log.info("decision %d (%s path): %s -> %s; predicted %s", self.decision_id, path, current, targets,
                 self.planner.predicted)
        self.planner.decided(targets, path, current)
        if not self.cfg.applies and not isinstance(self.connector, AdvisoryConnector):
            log.info("advisory: decision %d not applied", self.decision_id)
            return
        try:
            await self.connector.set_replicas(targets, self.decision_id)
        except Exception as exc:
            self.metrics.errors.labels("connector").inc()
            log.error("the connector failed to apply decision %d: %s", self.decision_id, exc)

    async def loop(self, stopping: asyncio.Event) -> None:
        cfg = self.cfg
        tick = cfg.fast_interval_s or cfg.adjustment_interval_s
        next_throughput = time.monotonic() + cfg.adjustment_interval_s
        await self.source.start()
        while not stopping.is_set():
            await _wait(stopping, min(tick, max(0.0, next_throughput - time.monotonic())))
            if stopping.is_set():
                return
            current, starting = await self.current()
            have = {r: current.get(r, 0) + starting.get(r, 0) for r in cfg.roles}
            if time.monotonic() >= next_throughput:
                # Intervals missed while a decision was applied are not made up for: the next
                # observation covers the whole time since the last one.
                next_throughput = max(next_throughput + cfg.adjustment_interval_s,
                                      time.monotonic() + cfg.adjustment_interval_s / 2)
                try:
                    obs = await self.source.observe(cfg.adjustment_interval_s)
                except Exception as exc:
                    self.metrics.errors.labels("scrape").inc()
                    log.warning("could not read the frontend's metrics: %s", exc)
                    continue
                log.info("interval: %.2f requests/s, ISL %s, OSL %s, TTFT %s s, ITL %s s, KV hit %s",
                         obs.request_rate, _f(obs.isl), _f(obs.osl), _f(obs.ttft_s), _f(obs.itl_s),
                         _f(obs.kv_hit_rate))
                # Requests in the engines now: with the finished ones, the interval's arrivals (planner.py).
                reports = self.loads.engines(max_age_s=max(3 * (cfg.fast_interval_s or 0), 10.0))
                in_system = sum(e.report.num_running + e.report.num_waiting for e in reports) if reports else None
                if in_system is not None:
                    in_system += await self.queued()  # those the frontend holds arrived too
                targets = await asyncio.to_thread(self.planner.throughput_step, obs, current, starting,
                                                  in_system)  # ARIMA fits
                log.info("throughput path: lower bound %s, keep %s, arrivals %.2f/s", self.planner.lower,
                         self.planner.keep, self.planner.last_rate)
                await self.decide(targets, have, "throughput")
            elif await self.woken_by_demand(have):
                continue
            elif cfg.fast_interval_s > 0:
                engines = self.loads.engines(max_age_s=max(3 * cfg.fast_interval_s, 10.0))
                await self.decide(self.planner.load_step(engines, current, starting, queued=await self.queued()),
                                  have, "load")

    async def woken_by_demand(self, have: dict[str, int]) -> bool:
        """Wake on demand: requests were answered 503 model_asleep since the last look (every worker of
        the model sleeps) and a role has no worker serving or starting: it gets one (the connector wakes
        a sleeper first). Checked every tick, so a sleeping model wakes within a fast interval."""
        try:
            total = await self.source.asleep_rejections()
        except Exception as exc:
            self.metrics.errors.labels("scrape").inc()
            log.warning("could not read the frontend's model_asleep answers: %s", exc)
            return False
        seen, self._asleep_seen = self._asleep_seen, total
        if seen is None or total <= seen:
            return False
        empty = [r for r in self.cfg.roles if have.get(r, 0) == 0]
        if not empty:
            return False
        targets = {r: max(have.get(r, 0), 1) for r in self.cfg.roles}
        log.info("demand: %d request(s) found every worker asleep; waking %s", total - seen, ", ".join(empty))
        self.planner.note_demand(empty)
        await self.decide(self.planner._clamp(targets, targets), have, "demand")
        return True

    async def queued(self) -> int:
        """Requests the frontend holds for a worker below its busy thresholds (0 when unreadable)."""
        try:
            return await self.source.queued()
        except Exception as exc:
            self.metrics.errors.labels("scrape").inc()
            log.warning("could not read the frontend's queued requests: %s", exc)
            return 0

    # -- process ----------------------------------------------------------------------
    def status_app(self):
        """/live; /health: "starting" (503) until the frontend and workers were seen, then "healthy";
        /metrics: the planner's own registry."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def live(_):
            return JSONResponse({"status": "live"})

        async def health(_):
            body = {"status": self.status, "mode": self.cfg.mode, "workers": self.visible,
                    "targets": self.planner.targets, "decision_id": self.decision_id}
            return JSONResponse(body, status_code=200 if self.status == "healthy" else 503)

        async def metrics(_):
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/live", live), Route("/health", health), Route("/metrics", metrics)])

    async def run(self, stopping: asyncio.Event) -> int:
        from turbine.config import make_registry
        from turbine.runtime.registration import advertised_address, unregister
        from turbine.runtime.status_server import serve_status

        cfg = self.cfg
        app = self.status_app()
        server = await serve_status(app, cfg.system_host, cfg.system_port)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.address = advertised_address(f"{cfg.system_host}:{port}")
        log.info("planner %s: status server on http://%s (mode %s, connector %s%s)", self.instance_id, self.address,
                 cfg.mode, cfg.connector, ", advisory" if not cfg.applies else "")
        registry = make_registry(cfg.discovery)
        await registry.backend.start()
        record = InstanceRecord(namespace=cfg.namespace, component=PLANNER_COMPONENT, endpoint=STATUS_ENDPOINT,
                                instance_id=self.instance_id, address=self.address, pid=os.getpid(),
                                hostname=socket.gethostname())
        follow = asyncio.create_task(self._follow(registry))
        try:
            await registry.register_instance(record)
            # The connector first: with no worker running, only it can bring the ones the planner waits for.
            await self.connector.start()
            await self.bring_to_minimum()
            if await self.wait_until_visible(stopping):
                self.status = "healthy"
                log.info("planning: the frontend answers and the workers are visible (%s)", self.visible)
                await self.loop(stopping)
        finally:
            follow.cancel()
            await unregister(registry, [record])
            await self.connector.close()
            await self.source.close()
            self.loads.close()
            await registry.backend.close()
            server.should_exit = True
        return 0


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def serve(cfg: PlannerConfig) -> int:
    from turbine.runtime import cluster_auth
    from turbine.runtime.lifecycle import stop_on_signals

    cluster_auth.install(cfg.security.auth())  # load reports are signed when the cluster has a key
    stopping = asyncio.Event()
    stop_on_signals(stopping)
    return await PlannerService(cfg).run(stopping)


def main(argv: list[str] | None = None) -> int:
    from turbine.logging_setup import setup_logging
    from turbine.planner.config import parse_planner_args

    setup_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape
    cfg = parse_planner_args(argv)
    return asyncio.run(serve(cfg))

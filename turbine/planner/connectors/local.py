"""The local connector: worker processes (vLLM or mocker) on this host, started and stopped by the
planner with the flags given per role.

A worker counts once it has registered: a model card in discovery under an instance record that
carries its pid. Scale-down picks the least-loaded worker of the role (one still starting first,
then the fewest generate requests in flight on its own /metrics) and sends it SIGTERM, which the
worker host turns into: unregister, serve what it holds for up to `drain_timeout` seconds, end what
still runs with `shutting_down` (the frontend migrates it), exit. Only then is the process gone;
the connector kills it (its process group) only if it outlives the drain by `kill_after` seconds.

With a sleeping pool (`sleep_pool` N > 0), a step down first puts workers to sleep, up to N of the
role asleep at once: `POST /engine/sleep` on the worker's status port, which takes it out of
discovery, drains it as a stop does (turbine/worker/sleep.py) and frees its engine's memory; only
the workers beyond the pool are stopped. A step up first wakes sleeping workers (`POST
/engine/wake_up`: the engine back, registered again; a second on a GPU against a cold start of
minutes) and starts processes only for the rest. A sleeping worker counts neither as ready nor as
starting (`sleeping_replicas`); its process, and its GPU, stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from turbine.config import DEFAULT_NAMESPACE, ConfigError, DiscoveryConfig, check, make_registry
from turbine.planner.connector import ROLES, register_connector
from turbine.runtime import cluster_auth
from turbine.runtime.ports import free_port

log = logging.getLogger("turbine.planner.local")

ENGINES = {"vllm": "turbine.vllm", "mocker": "turbine.mocker"}
# Flags the connector sets itself (from its config and the role), refused in a role's flags.
OWN_FLAGS = ("--system-port", "--graceful-shutdown-timeout", "--disaggregation-mode", "--is-prefill-worker",
             "--is-decode-worker", "--num-workers", "--discovery-backend", "--discovery-dir", "--etcd-endpoints",
             "--discovery-ttl")
INFLIGHT_METRIC = "turbine_worker_inflight_requests"


@dataclass(frozen=True)
class LocalRole:
    """How to start one worker of a role: `python -m turbine.<engine> <args>`, plus `env`."""

    engine: str = "mocker"
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        check(self, self.engine in ENGINES, "engine", f"choose from {', '.join(ENGINES)}")
        own = sorted({a.split("=", 1)[0] for a in self.args} & set(OWN_FLAGS))
        check(self, not own, "args", f"{', '.join(own)} are set by the local connector (one worker per process, "
                                     "its role, status port, drain bound and discovery come from its config)")


@dataclass(frozen=True)
class LocalConnectorConfig:
    roles: dict[str, LocalRole]
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    log_dir: str = "turbine-planner-workers"
    drain_timeout: float = 30.0  # each stopped worker's --graceful-shutdown-timeout
    kill_after: float = 30.0  # beyond the drain: then SIGKILL (a worker that hangs on exit)
    python: str = sys.executable
    # Take over the workers of these roles already registered from this host in `namespace` (e.g.
    # left by a planner that crashed, or started by hand): counted, and stopped (SIGTERM) on scale-down.
    # Its load is read, and it can sleep, when its command line names its --system-port; else it is
    # stopped after the connector's own, whose load it can read.
    adopt: bool = True
    namespace: str = DEFAULT_NAMESPACE
    sleep_pool: int = 0  # workers per role a step down puts to sleep (up to this many asleep) before it stops any
    sleep_level: int = 1  # 1: the KV cache freed, the weights kept in host memory; 2: the weights freed too

    @classmethod
    def from_dict(cls, options: dict, discovery: DiscoveryConfig | None = None,
                  namespace: str = DEFAULT_NAMESPACE) -> LocalConnectorConfig:
        """From the planner config's `connector_options` (YAML/JSON): {"roles": {ROLE: {"engine",
        "args", "env"}}, "log_dir", "drain_timeout", "kill_after", "python", "adopt", "sleep_pool",
        "sleep_level"}."""
        known = {"roles", "log_dir", "drain_timeout", "kill_after", "python", "adopt", "sleep_pool", "sleep_level"}
        if bad := sorted(set(options) - known):
            raise ConfigError(cls, "roles", f"unknown local connector option(s) {', '.join(bad)}; "
                                            f"known: {', '.join(sorted(known))}")
        roles = {}
        for role, spec in (options.get("roles") or {}).items():
            if bad := sorted(set(spec) - {"engine", "args", "env"}):
                raise ConfigError(LocalRole, "args", f"role {role}: unknown key(s) {', '.join(bad)}")
            roles[role] = LocalRole(spec.get("engine", "mocker"), tuple(str(a) for a in spec.get("args", ())),
                                    {str(k): str(v) for k, v in (spec.get("env") or {}).items()})
        rest = {k: options[k] for k in ("log_dir", "python") if k in options}
        rest.update({k: float(options[k]) for k in ("drain_timeout", "kill_after") if k in options})
        for k in ("sleep_pool", "sleep_level"):
            if k in options:
                try:
                    rest[k] = int(options[k])
                except (TypeError, ValueError):
                    raise ConfigError(cls, k, f"{options[k]!r}: expected an integer") from None
        if "adopt" in options:  # --connector-option adopt=false gives a string
            rest["adopt"] = options["adopt"] if isinstance(options["adopt"], bool) else \
                str(options["adopt"]).lower() in ("1", "true", "yes", "on")
        return cls(roles=roles, discovery=discovery or DiscoveryConfig(), namespace=namespace, **rest)

    def __post_init__(self):
        check(self, bool(self.roles), "roles", "name at least one role")
        bad = sorted(set(self.roles) - set(ROLES))
        check(self, not bad, "roles", f"unknown role(s) {', '.join(bad)}; choose from {', '.join(ROLES)}")
        check(self, self.drain_timeout >= 0, "drain_timeout", "must be >= 0")
        check(self, self.kill_after > 0, "kill_after", "must be > 0")
        check(self, self.sleep_pool >= 0, "sleep_pool", "must be >= 0 (0: no pool, a step down stops workers)")
        check(self, self.sleep_level in (1, 2), "sleep_level", "choose 1 (KV cache freed) or 2 (weights too)")


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _status_port(cmdline: list[str]) -> int | None:
    """The `--system-port N` (or `--system-port=N`) of a worker's command line; None when absent or 0."""
    for k, arg in enumerate(cmdline):
        value = arg.split("=", 1)[1] if arg.startswith("--system-port=") else \
            cmdline[k + 1] if arg == "--system-port" and k + 1 < len(cmdline) else None
        if value is not None:
            try:
                return int(value) or None
            except ValueError:
                return None
    return None


@dataclass
class LocalWorker:
    role: str
    name: str
    popen: subprocess.Popen | None  # None: adopted (a worker of this host that another process started)
    system_port: int | None  # None: unknown (adopted without --system-port): its load cannot be read, it cannot sleep
    log_path: Path | None
    started_at: float
    registered_at: float | None = None
    stop_requested_at: float | None = None
    stop_load: float | None = None  # its load when it was picked to stop
    adopted_pid: int = 0
    asleep: bool = False  # put to sleep by the pool: alive, out of discovery, woken on a step up
    sleeps: int = 0  # times put to sleep
    wakes: int = 0  # times woken

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self.adopted_pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            return psutil.Process(self.adopted_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


class LocalConnector:
    """Connector over processes on this host (see the module doc)."""

    def __init__(self, cfg: LocalConnectorConfig):
        self.cfg = cfg
        self.workers: list[LocalWorker] = []  # every worker started, stopped ones too (for the record)
        self.registry = make_registry(cfg.discovery)
        self._http: httpx.AsyncClient | None = None
        self._reapers: set[asyncio.Task] = set()
        self._seq = 0
        self.last_loads: dict[str, float] = {}  # worker name -> load, at the last scale-down's pick

    async def start(self) -> None:
        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        await self.registry.backend.start()
        self._http = httpx.AsyncClient(timeout=2.0)

    # -- what runs -------------------------------------------------------------------------------
    def serving(self, role: str | None = None) -> list[LocalWorker]:
        """Live workers not asked to stop nor asleep (starting or registered), of `role` or all."""
        return [w for w in self._live(role) if not w.asleep]

    def sleeping(self, role: str | None = None) -> list[LocalWorker]:
        """Live workers of the pool, asleep (of `role` or all)."""
        return [w for w in self._live(role) if w.asleep]

    def _live(self, role: str | None) -> list[LocalWorker]:
        return [w for w in self.workers
                if w.alive() and w.stop_requested_at is None and (role is None or w.role == role)]

    async def refresh(self) -> None:
        """Mark the workers whose model card is now in discovery as registered (and adopt this
        host's other registered workers of our roles, with `adopt`)."""
        waiting = [w for w in self.serving() if w.registered_at is None]
        if not waiting and not self.cfg.adopt:
            return
        instances = await self.registry.list_instances()
        cards = {c.path: c for c in await self.registry.list_models()}
        registered_pids = {i.pid for i in instances if i.path in cards}
        now = time.monotonic()
        if self.cfg.adopt:
            self._adopt(instances, cards, now)
        for w in waiting:
            if w.pid in registered_pids:
                w.registered_at = now
                log.info("worker %s (%s, pid %d) registered after %.1fs", w.name, w.role, w.pid, now - w.started_at)

    def _adopt(self, instances, cards, now: float) -> None:
        known = {w.pid for w in self.workers if w.alive()}
        host = socket.gethostname()
        for inst in instances:
            card = cards.get(inst.path)
            if (card is None or inst.pid in known or inst.pid <= 0 or inst.hostname != host
                    or card.namespace != self.cfg.namespace or card.disaggregation_mode not in self.cfg.roles):
                continue
            try:
                proc = psutil.Process(inst.pid)
                created, port = proc.create_time(), _status_port(proc.cmdline())
            except psutil.Error:
                continue
            known.add(inst.pid)
            self._seq += 1
            # Its status port, when its command line names it: its load can be read and it can sleep.
            w = LocalWorker(card.disaggregation_mode, f"{card.disaggregation_mode}-{self._seq}-adopted", None, port,
                            None, now - max(0.0, time.time() - created), registered_at=now, adopted_pid=inst.pid)
            self.workers.append(w)
            log.info("adopted %s: pid %d, registered as %s", w.name, inst.pid, inst.path)

    async def current_replicas(self) -> dict[str, int]:
        await self.refresh()
        return {role: sum(w.registered_at is not None for w in self.serving(role)) for role in self.cfg.roles}

    async def starting_replicas(self) -> dict[str, int]:
        """Workers started and alive, not registered yet (a refresh happens in current_replicas)."""
        return {role: sum(w.registered_at is None for w in self.serving(role)) for role in self.cfg.roles}

    async def sleeping_replicas(self) -> dict[str, int]:
        """Workers of the pool asleep per role: a step up wakes them before it starts any."""
        return {role: len(self.sleeping(role)) for role in self.cfg.roles}

    def pool_capacity(self) -> dict[str, int]:
        """The most workers per role the pool keeps asleep (`sleep_pool`)."""
        return dict.fromkeys(self.cfg.roles, self.cfg.sleep_pool)

    # -- changing it -----------------------------------------------------------------------------
    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None:
        """Wakes sleeping workers for the workers missing (returns once they serve again) and starts
        the rest (returns without waiting for them to register: they count in current_replicas once
        they have); puts the ones too many to sleep while the pool has room, stops the others, and
        returns once they have drained and slept or exited."""
        unknown = sorted(set(targets) - set(self.cfg.roles))
        if unknown:
            raise ValueError(f"the local connector has no launch flags for role(s) {', '.join(unknown)}")
        if bad := {r: t for r, t in targets.items() if t < 0}:
            raise ValueError(f"decision {decision_id}: negative target(s) {bad}")
        await self.refresh()
        stopping = []
        for role, target in targets.items():
            have = self.serving(role)
            if target > len(have):
                woken = await self._wake(role, target - len(have))
                for _ in range(target - len(have) - woken):
                    self._launch(role)
                log.info("decision %d: %s %d -> %d (woken %d, starting %d)", decision_id, role, len(have), target,
                         woken, target - len(have) - woken)
            elif target < len(have):
                victims = await self.pick_victims(have, len(have) - target)
                room = self.cfg.sleep_pool - len(self.sleeping(role))
                # To sleep: registered workers whose status port is known (one still starting, or adopted, stops).
                sleepers = [w for w in victims if w.registered_at is not None and w.system_port is not None][:room]
                log.info("decision %d: %s %d -> %d, %s", decision_id, role, len(have), target, ", ".join(
                    f"{'sleeping' if w in sleepers else 'stopping'} {w.name} (load {w.stop_load:g})" for w in victims))
                stopping += [self._put_to_sleep(w) if w in sleepers else self._stop(w) for w in victims]
        if stopping:
            await asyncio.gather(*stopping)

    def _control_headers(self) -> dict[str, str]:
        """With a cluster key, the workers' /engine/* routes want it (turbine/worker/sleep.py)."""
        key = cluster_auth.current().key
        return {"Authorization": f"Bearer {key.decode()}"} if key else {}

    async def _control(self, w: LocalWorker, action: str, body: dict) -> None:
        """POST /engine/<action> on the worker's status port; raises unless it succeeded."""
        assert self._http is not None, "start() first"
        # The sleep drains first (up to the worker's drain timeout): wait that long and more.
        r = await self._http.post(f"http://127.0.0.1:{w.system_port}/engine/{action}", json=body,
                                  headers=self._control_headers(), timeout=self.cfg.drain_timeout + 30.0)
        if r.status_code != 200:
            raise RuntimeError(f"{action} answered {r.status_code}: {r.text[:200]}")

    def _put_to_sleep(self, w: LocalWorker) -> asyncio.Task:
        """Into the pool: the worker unregisters, drains and sleeps (its status port's /engine/sleep);
        stopped instead when that fails."""
        w.asleep = True  # neither serving nor a candidate from now on
        w.stop_load = w.stop_load if w.stop_load is not None else 0.0

        async def sleep() -> None:
            began = time.monotonic()
            try:
                await self._control(w, "sleep", {"level": self.cfg.sleep_level})
            except (httpx.HTTPError, RuntimeError) as exc:
                log.warning("%s (pid %d) could not sleep (%s): stopping it", w.name, w.pid, exc)
                w.asleep = False
                await self._stop(w)
                return
            w.sleeps += 1
            log.info("%s (pid %d) asleep (level %d) after %.2fs: in the pool", w.name, w.pid, self.cfg.sleep_level,
                     time.monotonic() - began)

        task = asyncio.get_running_loop().create_task(sleep())
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)
        return task

    async def _wake(self, role: str, count: int) -> int:
        """Wake up to `count` of the role's sleeping workers (the longest asleep first: any is as
        good); returns how many serve again. One that fails to wake is stopped."""
        chosen = self.sleeping(role)[:count]
        if not chosen:
            return 0

        async def wake(w: LocalWorker) -> bool:
            began = time.monotonic()
            try:
                await self._control(w, "wake_up", {})
            except (httpx.HTTPError, RuntimeError) as exc:
                log.warning("%s (pid %d) did not wake (%s): stopping it", w.name, w.pid, exc)
                w.asleep = False
                self._stop(w)
                return False
            w.asleep, w.wakes, w.registered_at = False, w.wakes + 1, time.monotonic()  # wake_up registers it
            log.info("%s (pid %d) woken: serving again after %.2fs", w.name, w.pid, time.monotonic() - began)
            return True

        return sum(await asyncio.gather(*(wake(w) for w in chosen)))

    async def load_of(self, w: LocalWorker) -> float:
        """Generate requests in flight on the worker (its own gauge); -1 while it is not
        registered yet (stopping it costs nothing); +inf when its status port does not answer."""
        if w.registered_at is None:
            return -1.0
        if w.system_port is None:  # adopted, its status port not known
            return float("inf")
        assert self._http is not None, "start() first"
        try:
            r = await self._http.get(f"http://127.0.0.1:{w.system_port}/metrics")
            r.raise_for_status()
        except httpx.HTTPError:
            return float("inf")
        return _metric_sum(r.text, INFLIGHT_METRIC)

    async def pick_victims(self, candidates: list[LocalWorker], count: int) -> list[LocalWorker]:
        """The `count` least-loaded workers (ties: the youngest, which holds the least cache)."""
        loads = await asyncio.gather(*(self.load_of(w) for w in candidates))
        self.last_loads = {w.name: load for w, load in zip(candidates, loads, strict=True)}
        ranked = sorted(zip(loads, candidates, strict=True), key=lambda lw: (lw[0], -lw[1].started_at))
        for load, w in ranked[:count]:
            w.stop_load = load
        return [w for _, w in ranked[:count]]

    def _launch(self, role: str) -> LocalWorker:
        spec, cfg = self.cfg.roles[role], self.cfg
        self._seq += 1
        name = f"{role}-{self._seq}"
        port = free_port()
        disc = cfg.discovery
        env = dict(os.environ)
        env.update(TURBINE_DISCOVERY_BACKEND=disc.backend, TURBINE_DISCOVERY_DIR=disc.file_dir,
                   TURBINE_ETCD_ENDPOINTS=",".join(disc.etcd_endpoints), TURBINE_DISCOVERY_TTL=str(disc.ttl),
                   PYTHONUNBUFFERED="1")
        env.update(spec.env)
        cmd = [cfg.python, "-m", ENGINES[spec.engine], *spec.args, "--disaggregation-mode", role,
               "--system-port", str(port), "--graceful-shutdown-timeout", str(cfg.drain_timeout)]
        log_path = Path(cfg.log_dir) / f"{name}.log"
        with open(log_path, "ab") as out:
            # Its own process group: a worker that outlives its drain is killed with its engine's children.
            popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        w = LocalWorker(role, name, popen, port, log_path, time.monotonic())
        self.workers.append(w)
        log.info("started %s (pid %d): %s; log %s", name, popen.pid, " ".join(cmd), log_path)
        return w

    def _stop(self, w: LocalWorker) -> asyncio.Task:
        w.stop_requested_at = time.monotonic()
        if w.alive():
            os.kill(w.pid, signal.SIGTERM)
        task = asyncio.get_running_loop().create_task(self._reap(w))
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)
        return task

    async def _reap(self, w: LocalWorker) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout + self.cfg.kill_after
        while w.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if w.alive():
            log.warning("%s (pid %d) still runs %.0fs after SIGTERM: killing it", w.name, w.pid,
                        self.cfg.drain_timeout + self.cfg.kill_after)
            try:  # its process group (its engine's children) when we started it
                os.killpg(w.pid, signal.SIGKILL) if w.popen is not None else os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while w.alive():
                await asyncio.sleep(0.1)
        code = w.returncode  # None: adopted, not our child (its status is its parent's)
        log.log(logging.INFO if code in (0, None) else logging.WARNING, "%s (pid %d) exited %s after %.1fs", w.name,
                w.pid, "(status unknown)" if code is None else code, time.monotonic() - (w.stop_requested_at or 0))

    async def close(self) -> None:
        """Stop every worker this connector started (each drains) and wait for them."""
        for w in self._live(None):
            self._stop(w)
        if self._reapers:
            await asyncio.gather(*self._reapers, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        await self.registry.backend.close()


def _from_planner_config(config: object) -> LocalConnector:
    """`--connector local`: options from the planner config's `connector_options`, its discovery."""
    if isinstance(config, LocalConnectorConfig):
        return LocalConnector(config)
    return LocalConnector(LocalConnectorConfig.from_dict(getattr(config, "connector_options", None) or {},
                                                         getattr(config, "discovery", None),
                                                         getattr(config, "namespace", None) or DEFAULT_NAMESPACE))


register_connector("local", _from_planner_config)

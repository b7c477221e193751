"""The planner's decisions, apart from any I/O (so tests drive it with known numbers).

Two paths (docs: the README's Planner section):
- **throughput** (every `--adjustment-interval`): the interval's observed request rate feeds the
  predictor; the per-request means (ISL, OSL, KV hit rate) are pooled over the requests that
  finished in the last `MEANS_WINDOW` intervals (a request-weighted mean, not a forecast: they
  do not follow the day, and an interval's mean of a few requests is noise that a trend model
  extrapolates: Kalman once forecast an ISL of 0 from 739 then 469, and the OSL of the requests
  that finish within an interval swung 18-120 tokens around a mean of ~87). The predicted next
  interval is sized (replicas.py) and clamped. Without the load path this is the decision.
- **load** (every `--fast-interval`, when on): each engine's latest load report gives estimates
  of the TTFT a new request would see there, `(waiting + 1) x prefill_ms(effective ISL)`, and of
  its ITL, `decode_ms(running, KV tokens in use)`. A role gets +1 worker when ALL its engines are
  over target (prefill: TTFT; decode: ITL, or requests waiting for a batch slot; agg: either
  signal), and -1 when ALL are under `--scale-down-sensitivity` x the targets (agg: both).
  When neither, the role as a whole decides: +1 when its backlog (below) needs more engines than
  it has (ready + starting), -1 when it needs fewer than all but one of them. (An aggregated
  engine's ITL estimate leaves out the stall its prefills cause, so four engines took a burst
  for 20 s before every one of them was over target.)
  The step up is sized from the backlog, not +1: the requests in the role's engines (running and
  waiting) over what one engine holds at the targets (`_backlog_need`), at least +1; a burst that
  doubles the load would otherwise take a start-up per worker to catch up. One step at most
  doubles the role (ready + starting): the backlog is judged with the OSL of the requests that
  finished, which early on are the short ones (a queue of 9 on one engine once asked for 9 workers
  where 3 sufficed), and the next step may add more once these were asked for. The step down is
  half the surplus over the backlog's need (at least 1), never below what the highest arrival rate
  of the last start-up needs (`keep`, without the square-root spare: the throughput path's bound
  has it), and only once the role was under target for a whole start-up: every engine under
  target, or, when not every engine is under nor over, the backlog needing fewer than all but one
  of its engines (with many engines one of them nearly always has a prompt waiting: nine workers
  held through a decline of the load on the benchmark's fleet) (else each interval:
  a worker stopped now cannot be back sooner than that if the load returns, so it waits out a
  dip shorter than a start-up); that time counts from when the role's workers all serve.
  With this path on, the throughput path's result is a lower bound: a role never goes below
  it, and rises to it at once, but only the load path brings a role down (so the two do not
  undo each other every interval). After a role changed, the load path waits for a report
  from every worker of it that came after the change (new workers included), so it does not
  add again while the last one is still starting or taking its share. While a worker of a role
  is starting (asked for, not ready: the connector's `starting_replicas`), the load path neither
  adds to nor removes from that role: the one to come is the capacity it asked for (it adds only
  when the backlog needs more than the ready and starting workers together).

Start-up delay: workers asked for now serve only after a start-up (`--startup-s`, else the median
of the start-ups observed: a role's first worker asked for until its ready count rose). So the
throughput path sizes for the highest request rate predicted over the intervals until then and the
interval after (`horizon()` steps: 1 + ceil(start-up / interval); 1 with no start-up known).

Sleeping pool (a connector that keeps one: `sleeping_replicas` / `pool_capacity`, e.g. the local
connector's `sleep_pool`): a worker woken from it serves after `--wake-s` (a second on a GPU), one
started cold after the start-up. So the delays are two: the throughput path sizes the wake horizon's
rate (`horizon(wake)`) when the start-up horizon's need fits in what serves, starts and sleeps now
(the sleepers cover it: nothing to start cold yet), else the start-up horizon's need (`delay_s`); a
step down that puts a worker to sleep (the pool has room) can be undone in a wake, so the load
path's wait under target and `keep`'s window are the wake's then, a start-up's otherwise
(`down_delay_s`); before a whole start-up under target it removes no more than the pool has room
for.

The request rate the throughput path predicts from is the interval's arrivals, counted as the
requests that finished plus the change in those in the engines (running + waiting, from the load
reports, `in_system`): finished requests alone lag the arrivals by a request's lifetime and, while
the engines are saturated, count their capacity, not the demand.

The throughput path keeps the last decision above its bound; the load path steps from the last
decision, or, in advisory mode (nothing is applied), from the workers running now.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from turbine.planner.config import PlannerConfig
from turbine.planner.load_reports import EngineLoad
from turbine.planner.metrics import PlannerMetrics
from turbine.planner.observe import Observation
from turbine.planner.predictors import make_predictor
from turbine.planner.profile import PerformanceModel
from turbine.planner.replicas import Load, Sizing, clamp, size

log = logging.getLogger("turbine.planner")

MEANS_WINDOW = 6  # intervals whose finished requests the ISL / OSL / KV hit rate means pool


@dataclass(frozen=True)
class EngineEstimate:
    role: str
    ttft_ms: float | None  # None: no ISL observed yet
    itl_ms: float
    waiting: int


def estimate(engine: EngineLoad, model: PerformanceModel, isl_eff: float | None) -> EngineEstimate:
    r = engine.report
    itl = model.decode_ms(r.num_running, r.kv_active_blocks * engine.block_size) if r.num_running else 0.0
    ttft = (r.num_waiting + 1) * model.prefill_ms(isl_eff) if isl_eff else None
    return EngineEstimate(engine.role, ttft, itl, r.num_waiting)


def direction(role: str, engines: list[EngineEstimate], ttft_ms: float, itl_ms: float, sensitivity: float) -> int:
    """+1, -1 or 0 for a role from its engines' estimates (the rule in the module's docstring)."""
    if not engines:
        return 0
    ttfts = [e.ttft_ms for e in engines]
    known = None not in ttfts
    ttft_over = known and all(t > ttft_ms for t in ttfts)
    ttft_under = known and all(t < sensitivity * ttft_ms for t in ttfts)
    itl_over = all(e.itl_ms > itl_ms or e.waiting > 0 for e in engines)
    itl_under = all(e.itl_ms < sensitivity * itl_ms and e.waiting == 0 for e in engines)
    if role == "prefill":
        over, under = ttft_over, ttft_under
    elif role == "decode":
        over, under = itl_over, itl_under
    else:
        over, under = ttft_over or itl_over, ttft_under and itl_under
    return 1 if over else -1 if under else 0


@dataclass
class Planner:
    cfg: PlannerConfig
    model: PerformanceModel
    metrics: PlannerMetrics = field(default_factory=PlannerMetrics)

    def __post_init__(self):
        self._predictors = {"request_rate": make_predictor(self.cfg.predictor)}
        # Per interval with finished requests: (requests, ISL tokens, OSL tokens, cached prompt tokens).
        self._finished: deque[tuple[float, float, float, float]] = deque(maxlen=MEANS_WINDOW)
        self.predicted: Load | None = None
        self.lower: dict[str, int] = {}  # the throughput path's last result
        self.targets: dict[str, int] = {}  # the last decision
        self.last_sizing: Sizing | None = None
        self.changed_at: dict[str, float] = {}  # role -> when its target last changed (monotonic)
        self._unreachable: set[str] = set()  # roles whose target one engine cannot meet (warned)
        self.startups: deque[float] = deque(maxlen=8)  # observed start-ups, s (newest last)
        self._in_system: int | None = None  # requests in the engines at the last throughput step
        self._under_since: dict[str, float] = {}  # role -> since when every engine has been under target
        self._rates: deque[float] = deque(maxlen=16)  # observed arrival rates, newest last
        self.keep: dict[str, int] = {}  # what the highest rate of the last start-up needs: no step down below
        self.last_rate = 0.0  # the last interval's arrivals per second
        # The connector's sleeping pool (planner.py's docstring): role -> workers asleep / the most it keeps.
        self.asleep: dict[str, int] = {}
        self.pool_capacity: dict[str, int] = {}
        self.predicted_wake: Load | None = None  # the load over the wake horizon (with a pool)
        self._demand_at: dict[str, float] = {}  # role -> when a worker was woken on demand (note_demand)

    # -- start-up delay ------------------------------------------------------------------
    def note_startup(self, seconds: float) -> None:
        self.startups.append(max(0.0, seconds))

    def startup_s(self) -> float:
        """The expected start-up: configured, else the median observed, else 0."""
        if self.cfg.startup_s is not None:
            return self.cfg.startup_s
        return statistics.median(self.startups) if self.startups else 0.0

    def horizon(self, delay_s: float | None = None) -> int:
        """Intervals ahead the throughput path provisions for a delay (default: the start-up; see the
        module's docstring)."""
        delay = self.startup_s() if delay_s is None else delay_s
        return 1 + math.ceil(delay / self.cfg.adjustment_interval_s) if delay > 0 else 1

    # -- sleeping pool -------------------------------------------------------------------
    def note_pool(self, asleep: dict[str, int], capacity: dict[str, int]) -> None:
        """The connector's pool now: workers asleep per role and the most it keeps asleep."""
        self.asleep, self.pool_capacity = dict(asleep), dict(capacity)

    def note_demand(self, roles: list[str], now: float | None = None) -> None:
        """Requests found these roles asleep and a worker was woken for them: none of them steps down
        within an adjustment interval (the woken worker is there for the demand, not a dip)."""
        now = time.monotonic() if now is None else now
        for role in roles:
            self._demand_at[role] = now
            self._under_since.pop(role, None)

    @property
    def has_pool(self) -> bool:
        return any(n > 0 for n in self.pool_capacity.values())

    def delay_s(self, role: str, adding: int) -> float:
        """Until `adding` more workers of `role` serve: a wake when the sleepers cover them, else a start-up."""
        return self.cfg.wake_s if 0 < adding <= self.asleep.get(role, 0) else self.startup_s()

    def down_delay_s(self, role: str) -> float:
        """Until a worker of `role` taken out now could serve again: a wake when the pool has room for it."""
        room = self.pool_capacity.get(role, 0) - self.asleep.get(role, 0)
        return min(self.cfg.wake_s, self.startup_s()) if room > 0 else self.startup_s()

    @staticmethod
    def _have(current: dict[str, int], starting: dict[str, int] | None) -> dict[str, int]:
        """Ready plus starting workers per role: what runs or is coming."""
        starting = starting or {}
        return {r: current.get(r, 0) + starting.get(r, 0) for r in set(current) | set(starting)}

    def _base(self, current: dict[str, int], starting: dict[str, int] | None = None) -> dict[str, int]:
        """What a decision steps from: the last decision, or what runs or starts when nothing is applied."""
        have = self._have(current, starting)
        return (self.targets or have) if self.cfg.applies else have

    # -- bounds -------------------------------------------------------------------------
    def _clamp(self, wanted: dict[str, int], lower: dict[str, int] | None = None) -> dict[str, int]:
        roles = self.cfg.roles
        minimum = {r: max(self.cfg.minimum(r), (lower or {}).get(r, 0)) for r in roles}
        minimum = {r: min(n, self.cfg.maximum(r)) for r, n in minimum.items()}
        maximum = {r: self.cfg.maximum(r) for r in roles}
        try:
            return clamp(wanted, minimum, maximum, self.cfg.max_workers)
        except ValueError:  # the lower bounds alone exceed the budget: share it from the configured minimums
            return clamp(wanted, {r: self.cfg.minimum(r) for r in roles}, maximum, self.cfg.max_workers)

    # -- throughput path -------------------------------------------------------------------
    def arrival_rate(self, obs: Observation, in_system: int | None) -> float:
        """The interval's arrivals per second: finished + the change in requests in the engines
        (the module's docstring); the finished rate alone while either count is unknown."""
        rate = obs.request_rate
        if in_system is not None and self._in_system is not None and obs.seconds > 0:
            rate = max(0.0, rate + (in_system - self._in_system) / obs.seconds)
        if in_system is not None:
            self._in_system = in_system
        return rate

    def observe(self, obs: Observation, in_system: int | None = None) -> Load | None:
        """Feed the predictors one interval; return the predicted next one (None: no traffic seen yet).
        `in_system`: requests in the engines now (running + waiting), for the arrival rate."""
        m = self.metrics.observed
        rate = self.last_rate = self.arrival_rate(obs, in_system)
        m.labels("request_rate").set(rate)
        for name, value in (("isl", obs.isl), ("osl", obs.osl), ("ttft_seconds", obs.ttft_s),
                            ("itl_seconds", obs.itl_s), ("kv_hit_rate", obs.kv_hit_rate)):
            if value is not None:
                m.labels(name).set(value)
        p = self._predictors
        p["request_rate"].add(rate)  # a rate: intervals may differ in length
        self._rates.append(rate)
        # Means exist only for intervals where requests finished; an idle interval keeps them.
        if obs.isl is not None and obs.requests > 0:
            isl_tokens = obs.isl * obs.requests
            self._finished.append((obs.requests, isl_tokens, (obs.osl or 0.0) * obs.requests,
                                   (obs.kv_hit_rate or 0.0) * isl_tokens))
        if not self._finished:
            return None
        # The highest rate until the workers started now are ready and over the interval after.
        rate = max(p["request_rate"].forecast(self.horizon()))
        self.metrics.horizon.set(self.horizon())
        n, isl_tokens, osl_tokens, cached = (sum(col) for col in zip(*self._finished, strict=True))
        self.predicted = Load(request_rate=rate, isl=isl_tokens / n, osl=osl_tokens / n,
                              kv_hit_rate=min(1.0, cached / isl_tokens) if isl_tokens > 0 else 0.0)
        self.predicted_wake = None
        if self.has_pool:  # the rate until a woken worker serves (and the interval after)
            wake_rate = max(p["request_rate"].forecast(self.horizon(min(self.cfg.wake_s, self.startup_s()))))
            self.predicted_wake = Load(wake_rate, self.predicted.isl, self.predicted.osl, self.predicted.kv_hit_rate)
        pm = self.metrics.predicted
        pm.labels("request_rate").set(self.predicted.request_rate)
        pm.labels("isl").set(self.predicted.isl)
        pm.labels("osl").set(self.predicted.osl)
        pm.labels("kv_hit_rate").set(self.predicted.kv_hit_rate)
        return self.predicted

    def throughput_step(self, obs: Observation, current: dict[str, int],
                        starting: dict[str, int] | None = None, in_system: int | None = None) -> dict[str, int]:
        """The throughput path's decision after one interval (the current counts when nothing was seen yet).
        Its target is compared against ready + starting workers: those starting count as capacity."""
        load = self.observe(obs, in_system)
        base = self.targets or self._have(current, starting)
        if load is None:
            return self._clamp({r: base.get(r, 0) for r in self.cfg.roles})
        share = self.cfg.target_share  # room for the requests above the mean the model gives
        beta = self.cfg.sqrt_staffing
        sizing = size(self.cfg.mode, self.model, load, share * self.cfg.ttft_ms, share * self.cfg.itl_ms, beta=beta)
        self.last_sizing = sizing
        for role, rate in (("prefill", sizing.prefill), ("decode", sizing.decode)):
            if rate is None:
                continue
            label = f"agg_{role}" if self.cfg.mode == "agg" else role  # an agg engine's prefill / decode share
            self.metrics.engine_rate.labels(label).set(rate.requests_per_s)
            self.metrics.reachable.labels(label).set(1 if rate.reachable else 0)
            if rate.reachable:
                self._unreachable.discard(role)
            elif role not in self._unreachable:  # said once until it is reachable again
                self._unreachable.add(role)
                target = "TTFT" if role == "prefill" else "ITL"
                log.warning("the %s target cannot be met by one engine even unloaded (%s step %.1f ms); planning "
                            "for the least delay the profile allows", target, role, rate.step_ms)
        wanted = dict(sizing.replicas)
        if self.predicted_wake is not None:
            # Two delays (the module's docstring): what the start-up horizon needs is started now only when
            # the sleepers cannot cover it; else the wake horizon's need, woken when it comes.
            have = self._have(current, starting)
            soon = size(self.cfg.mode, self.model, self.predicted_wake, share * self.cfg.ttft_ms,
                        share * self.cfg.itl_ms, beta=beta).replicas
            for role, n in wanted.items():
                if n <= have.get(role, 0) + self.asleep.get(role, 0):
                    wanted[role] = soon.get(role, n)
        self.lower = self._clamp(wanted)
        # The load path steps down no lower than what the highest arrival rate seen over the last start-up
        # (and interval) needs: a dip shorter than a start-up is not worth a worker that could not be back
        # in time (the forecast alone may dip below it: a trend fitted to a noisy interval). One interval
        # more than the start-up: an interval's rate swings with its few arrivals (±15 % at 40), and on a
        # 480 s day keeping only the last one stepped down mid-peak and missed the next interval's.
        # With a pool that has room, a worker taken out is back in a wake: the window is the wake's (per role).
        self.keep = {}
        for role in self.cfg.roles:
            recent = max(list(self._rates)[-self.horizon(self.down_delay_s(role)):])
            self.keep[role] = self._clamp(size(self.cfg.mode, self.model,
                                               Load(recent, load.isl, load.osl, load.kv_hit_rate),
                                               share * self.cfg.ttft_ms, share * self.cfg.itl_ms).replicas)[role]
        for role, n in self.lower.items():
            self.metrics.throughput_replicas.labels(role).set(n)
        if self.cfg.fast_interval_s > 0:
            # A lower bound for the load path: rise to it now, come down only through the load path.
            return self._clamp({r: max(self.lower[r], base.get(r, 0)) for r in self.cfg.roles}, self.lower)
        return self.lower

    # -- load path -------------------------------------------------------------------------
    def isl_eff(self) -> float | None:
        if self.predicted is None:
            return None
        return max(1.0, self.predicted.isl * (1.0 - self.predicted.kv_hit_rate))

    def _backlog_need(self, role: str, engines: list[EngineLoad], queued: int = 0) -> int | None:
        """Engines of `role` that the requests in it now need at the targets (None: not sized yet):
        decode and agg: running + waiting over one engine's concurrency at the targets; prefill:
        the queued prompts' prefill time over the TTFT target. `queued`: requests the frontend holds
        for a worker below its busy thresholds (turbine/frontend/models/busy_queue.py): each still needs
        its prefill and its decode, so they count in every role."""
        sizing, isl_eff = self.last_sizing, self.isl_eff()
        if sizing is None or self.predicted is None or isl_eff is None:
            return None
        if role == "prefill":
            work_ms = (sum(e.report.num_waiting + e.report.num_running for e in engines) + queued) \
                * self.model.prefill_ms(isl_eff)
            return math.ceil(work_ms / (self.cfg.target_share * self.cfg.ttft_ms) - 1e-9)
        rate = sizing.agg if role == "agg" else sizing.decode
        if rate is None:
            return None
        # Little's law: an engine at `requests_per_s` keeps that times a request's stay in it.
        holds = max(1.0, rate.requests_per_s * max(self.predicted.osl, 1.0) * rate.step_ms / 1000.0)
        return math.ceil((sum(e.report.num_running + e.report.num_waiting for e in engines) + queued) / holds - 1e-9)

    def load_step(self, engines: list[EngineLoad], current: dict[str, int],
                  starting: dict[str, int] | None = None, now: float | None = None,
                  queued: int = 0) -> dict[str, int] | None:
        """The load path's decision from the engines' latest reports (None: no change); `starting`:
        workers per role asked for and not ready yet (none is added to a role while one starts);
        `queued`: requests waiting at the frontend for a worker below its busy thresholds (they
        count in the backlog, and while any wait no role steps down: every engine is as full as
        the thresholds let it be, however far under target its estimates are)."""
        starting = starting or {}
        now = time.monotonic() if now is None else now
        base = self._base(current, starting)
        isl_eff = self.isl_eff()
        wanted = {}
        for role in self.cfg.roles:
            mine = [e for e in engines if e.role == role]
            since = self.changed_at.get(role)
            if since is not None and (any(e.at < since for e in mine)
                                      or len({e.report.instance_id for e in mine}) < current.get(role, 0)):
                wanted[role] = base.get(role, 0)  # not every worker has reported since the change
                self._under_since.pop(role, None)  # the time under target counts from a settled role
                continue
            estimates = [estimate(e, self.model, isl_eff) for e in mine]
            if estimates:
                known = [e.ttft_ms for e in estimates if e.ttft_ms is not None]
                if known:
                    self.metrics.estimated.labels(role, "ttft").set(sum(known) / len(known))
                self.metrics.estimated.labels(role, "itl").set(sum(e.itl_ms for e in estimates) / len(estimates))
            step = direction(role, estimates, self.cfg.ttft_ms, self.cfg.itl_ms, self.cfg.scale_down_sensitivity)
            if step < 0 and queued > 0:
                step = 0  # requests wait for a worker: not a surplus (the docstring)
            if step < 0 and now - self._demand_at.get(role, -math.inf) < self.cfg.adjustment_interval_s:
                step = 0  # woken on demand: kept an interval (note_demand)
            if step == 0 and (backlog := self._backlog_need(role, mine, queued)) is not None:
                # Neither every engine over nor every one under: the role as a whole (the module's docstring).
                if backlog > base.get(role, 0):
                    step = 1
                elif backlog < base.get(role, 0) - 1 and not queued:
                    step = -1
            if step < 0:
                # Hysteresis: down only once under target for a whole start-up (the module's docstring).
                since_under = self._under_since.setdefault(role, now)
                if now - since_under < self.down_delay_s(role):  # a wake's wait when it goes to sleep
                    step = 0
                elif (need := self._backlog_need(role, mine, queued)) is not None and need < base.get(role, 0) - 1:
                    # Half the surplus over what the backlog needs at a time: a fleet sized for a peak comes
                    # down in a few start-ups, not one worker each, and keeps room if the load returns.
                    step = -math.ceil((base.get(role, 0) - need) / 2)
                if step < 0 and now - since_under < self.startup_s():
                    # Under target for a wake only: only as many as go into the pool (those would stop cold).
                    step = max(step, -(self.pool_capacity.get(role, 0) - self.asleep.get(role, 0)))
            else:
                self._under_since.pop(role, None)
            need = None
            if step > 0:
                need = self._backlog_need(role, mine, queued)
                if need is not None:
                    step = max(1, need - base.get(role, 0))  # sized from the backlog (the module's docstring)
                    step = min(step, max(1, base.get(role, 0)))  # at most doubling (the module's docstring)
            if step < 0:
                step = max(step, min(0, self.keep.get(role, 0) - base.get(role, 0)))  # not below `keep`
            if starting.get(role, 0) > 0 and not (need is not None and need > base.get(role, 0)):
                # The worker still starting is the capacity asked for: judge again once it serves (adding
                # now overshoots; removing now stops it, the least loaded, and thrashes: seen on a live fleet).
                # Unless the backlog needs more than ready + starting (`base`): a burst that began while one
                # starts would otherwise wait a whole start-up more. The time under target counts from
                # when it serves (a step down right after a start-up undid a burst's step up, 4 s later
                # up again: seen on the benchmark's fleet).
                step = 0
                self._under_since.pop(role, None)
            if step:
                running = sum(e.report.num_running for e in mine)
                waiting = sum(e.report.num_waiting for e in mine)
                log.info("load path: %s %+d from %d (engines %d: %d running, %d waiting; frontend queue %d; "
                         "backlog needs %s, keep %s, lower bound %s)", role, step, base.get(role, 0), len(mine),
                         running, waiting, queued, self._backlog_need(role, mine, queued), self.keep.get(role),
                         self.lower.get(role))
            wanted[role] = base.get(role, 0) + step
        targets = self._clamp(wanted, self.lower)
        for role in targets:
            if targets[role] < base.get(role, 0):
                self._under_since.pop(role, None)  # the next step down waits a whole start-up again
        return None if all(targets[r] == base.get(r, 0) for r in targets) else targets

    def decided(self, targets: dict[str, int], path: str, current: dict[str, int] | None = None) -> None:
        """Record a decision that is being applied (`current`: what ran, for the first decision)."""
        before = self.targets or current or {}
        for role, n in targets.items():
            was = before.get(role)
            if n != was:
                self.changed_at[role] = time.monotonic()
            if was is not None and n != was:
                self.metrics.decisions.labels(path, role, "up" if n > was else "down").inc()
            self.metrics.target_replicas.labels(role).set(n)
        self.targets = dict(targets)

"""The sleeping pool (issue #34): the planner's maths with two delays (a wake, a start-up), the
local connector's pool logic (a step down sleeps before it stops, a step up wakes before it starts;
its control calls scripted here, real processes in tests/integration/test_planner_sleep_pool.py),
and the service's wake on demand from the frontend's 503 model_asleep answers."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.unit.planner.test_planner_logic import engine, later, planner, profile_path  # noqa: F401 (fixture)
from tests.unit.planner.test_starting_workers import ScriptedConnector, service
from turbine.config import ConfigError, DiscoveryConfig
from turbine.frontend.errors import ModelAsleep
from turbine.frontend.metrics import FrontendMetrics
from turbine.planner.connectors.local import LocalConnector, LocalConnectorConfig, LocalRole, LocalWorker, _status_port
from turbine.planner.observe import ASLEEP, Observation, parse_queued


def obs(n):
    return Observation(seconds=10, requests=n, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)


# -- the replica maths with both delays ----------------------------------------------------------
def rising(profile_path, asleep=None, capacity=None, **kw):  # noqa: F811
    """A Kalman planner fed a rising rate (1, 2, 3, 4 requests/s) with a 15 s start-up and a 1 s wake."""
    p = planner(profile_path, mode="agg", fast_interval_s=0, predictor="kalman", max_replicas={"agg": 50},
                startup_s=15, wake_s=1, **kw)
    if capacity is not None:
        p.note_pool(asleep or {}, capacity)
    for n in (10, 20, 30, 40):
        p.throughput_step(obs(n), {"agg": 1})
    return p


def test_the_throughput_path_wakes_for_the_wake_horizon_when_the_sleepers_cover_the_start_ups(profile_path):  # noqa: F811
    cold = rising(profile_path)  # no pool: the start-up's horizon, 1 + ceil(15 / 10) = 3 intervals
    covered = rising(profile_path, asleep={"agg": 49}, capacity={"agg": 49})
    empty = rising(profile_path, asleep={"agg": 0}, capacity={"agg": 49})
    assert cold.horizon() == 3 and covered.horizon(1.0) == 2
    # Sleepers enough for what the start-up horizon needs: nothing starts cold, the wake horizon's need
    # (7 -> 6 requests/s at the trend of 1 per interval) is asked for now, the rest woken when it comes.
    assert covered.predicted_wake.request_rate == pytest.approx(6.0, rel=0.05)
    assert covered.lower["agg"] < cold.lower["agg"]
    # A pool with nobody asleep: a worker asked for now starts cold, so the start-up's horizon.
    assert empty.lower == cold.lower


def test_the_delays_follow_the_pool(profile_path):  # noqa: F811
    p = planner(profile_path, mode="agg", startup_s=15, wake_s=0.5)
    assert p.delay_s("agg", 1) == 15 and p.down_delay_s("agg") == 15  # no pool
    p.note_pool({"agg": 2}, {"agg": 3})
    assert p.delay_s("agg", 2) == 0.5 and p.delay_s("agg", 3) == 15  # 2 asleep: a third starts cold
    assert p.down_delay_s("agg") == 0.5  # room for one more: a step down sleeps it, back in a wake
    p.note_pool({"agg": 3}, {"agg": 3})
    assert p.down_delay_s("agg") == 15  # full: a step down stops one
    with pytest.raises(ConfigError, match="wake_s"):
        planner(profile_path, wake_s=-1)


def test_with_room_in_the_pool_the_load_path_steps_down_after_a_wake_not_a_start_up(profile_path):  # noqa: F811
    # 1/s then 0.1/s twice, start-up 15 s (a window of 3 intervals keeps 3 engines: test_planner_logic.py's
    # keep test), wake 1 s (a window of 2 intervals: 0.1/s, 1 engine).
    def run(pool, asleep=0):
        p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15, wake_s=1,
                    connector="local", connector_options={"roles": {"agg": {}}})
        p.note_pool({"agg": asleep}, {"agg": pool})
        for n in (10, 1, 1):
            p.throughput_step(obs(n), {"agg": 1})
        p.decided({"agg": 4}, "load")
        time.sleep(0.01)
        idle = [engine("agg", name=f"a{i}") for i in range(4)]
        t0 = later()
        return p, [p.load_step(idle, {"agg": 4}, now=t0 + dt) for dt in (0, 2, 15)]

    pooled, steps = run(pool=4)
    assert pooled.keep == {"agg": 1}
    assert steps == [None, {"agg": 2}, None]  # under target for a wake (1 s): half the surplus (of 4 idle)
    # Room for one only: after a wake, one goes to sleep (not half the surplus: those would stop cold).
    _, steps = run(pool=4, asleep=3)
    assert steps == [None, {"agg": 3}, None]
    cold, steps = run(pool=0)
    assert cold.keep == {"agg": 3}
    assert steps == [None, None, {"agg": 3}]  # a whole start-up first, and not below `keep`


# -- the local connector's pool ----------------------------------------------------------------------
class Scripted(LocalConnector):
    """The local connector with its process and HTTP side scripted: `_control` answers from `fail`."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.controls: list[tuple[str, str]] = []
        self.launched: list[str] = []
        self.stopped: list[str] = []
        self.fail: set[tuple[str, str]] = set()

    async def refresh(self):
        return None

    async def load_of(self, w):
        return float(w.name.rsplit("-", 1)[1])  # agg-0 the least loaded

    async def _control(self, w, action, body):
        self.controls.append((w.name, action))
        if (w.name, action) in self.fail:
            raise RuntimeError(f"{action} answered 500")

    def _launch(self, role):
        self.launched.append(role)
        return self.fake(f"{role}-new{len(self.launched)}")

    def _stop(self, w):
        w.stop_requested_at = time.monotonic()
        self.stopped.append(w.name)

        async def done():
            return None
        return asyncio.get_running_loop().create_task(done())

    def fake(self, name):
        w = LocalWorker("agg", name, None, 1, None, time.monotonic(), registered_at=time.monotonic(),
                        adopted_pid=os.getpid())  # alive: this process
        self.workers.append(w)
        return w


def scripted(tmp_path, pool=1, n=3):
    cfg = LocalConnectorConfig(roles={"agg": LocalRole()}, discovery=DiscoveryConfig(backend="file",
                               file_dir=str(tmp_path)), log_dir=str(tmp_path), adopt=False, sleep_pool=pool)
    conn = Scripted(cfg)
    for k in range(n):
        conn.fake(f"agg-{k}")
    return conn


async def test_a_step_down_sleeps_up_to_the_pool_and_stops_the_rest_a_step_up_wakes_first(tmp_path):
    conn = scripted(tmp_path, pool=1, n=3)
    await conn.set_replicas({"agg": 1}, 1)  # 3 -> 1: the two least loaded; one sleeps, one stops
    assert conn.controls == [("agg-0", "sleep")] and conn.stopped == ["agg-1"]
    assert await conn.current_replicas() == {"agg": 1} and await conn.sleeping_replicas() == {"agg": 1}
    assert conn.pool_capacity() == {"agg": 1}
    await conn.set_replicas({"agg": 3}, 2)  # 1 -> 3: the sleeper woken, one started
    assert conn.controls[-1] == ("agg-0", "wake_up") and conn.launched == ["agg"]
    assert await conn.sleeping_replicas() == {"agg": 0} and len(conn.serving("agg")) == 3
    woken = next(w for w in conn.workers if w.name == "agg-0")
    assert (woken.sleeps, woken.wakes, woken.asleep) == (1, 1, False)


async def test_without_a_pool_a_step_down_stops_and_a_step_up_starts(tmp_path):
    conn = scripted(tmp_path, pool=0, n=2)
    await conn.set_replicas({"agg": 1}, 1)
    await conn.set_replicas({"agg": 2}, 2)
    assert conn.controls == [] and conn.stopped == ["agg-0"] and conn.launched == ["agg"]


async def test_a_worker_that_cannot_sleep_is_stopped_and_one_that_cannot_wake_is_replaced(tmp_path):
    conn = scripted(tmp_path, pool=2, n=3)
    conn.fail = {("agg-0", "sleep"), ("agg-1", "wake_up")}
    await conn.set_replicas({"agg": 1}, 1)  # agg-0 fails to sleep: stopped; agg-1 sleeps
    assert conn.stopped == ["agg-0"] and [w.name for w in conn.sleeping("agg")] == ["agg-1"]
    await conn.set_replicas({"agg": 2}, 2)  # agg-1 fails to wake: stopped, one started instead
    assert conn.stopped == ["agg-0", "agg-1"] and conn.launched == ["agg"]
    assert await conn.sleeping_replicas() == {"agg": 0}


async def test_a_worker_still_starting_is_stopped_not_slept(tmp_path):
    conn = scripted(tmp_path, pool=2, n=1)
    starting = conn.fake("agg-9")
    starting.registered_at = None
    conn.load_of = lambda w: _const(-1.0 if w is starting else 5.0)
    await conn.set_replicas({"agg": 1}, 1)
    assert conn.stopped == ["agg-9"] and conn.controls == []


async def _const(v):
    return v


def test_pool_options_are_read_and_checked():
    cfg = LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "sleep_pool": "3", "sleep_level": 2})
    assert (cfg.sleep_pool, cfg.sleep_level) == (3, 2)
    with pytest.raises(ConfigError, match="sleep_pool"):
        LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "sleep_pool": -1})
    with pytest.raises(ConfigError, match="sleep_pool"):
        LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "sleep_pool": "many"})
    with pytest.raises(ConfigError, match="sleep_level"):
        LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "sleep_level": 3})


def test_an_adopted_workers_status_port_comes_from_its_command_line():
    assert _status_port(["python", "-m", "turbine.mocker", "--system-port", "8123"]) == 8123
    assert _status_port(["python", "-m", "turbine.vllm", "--system-port=9000"]) == 9000
    assert _status_port(["python", "-m", "turbine.mocker"]) is None
    assert _status_port(["x", "--system-port", "0"]) is None


# -- wake on demand ------------------------------------------------------------------------------------
def test_the_frontend_counts_its_model_asleep_answers_by_model():
    from prometheus_client import generate_latest

    fm = FrontendMetrics()
    fm.asleep.labels("m").inc(2)
    fm.asleep.labels("other").inc()
    text = generate_latest(fm.registry).decode()
    assert parse_queued(text, "m", ASLEEP) == 2 and parse_queued(text, None, ASLEEP) == 3
    assert ModelAsleep("m").model == "m" and ModelAsleep("m").status == 503


class DemandSource:
    def __init__(self):
        self.total = 0

    async def asleep_rejections(self):
        return self.total


def test_requests_that_find_the_model_asleep_wake_a_worker(profile_path):  # noqa: F811
    conn = ScriptedConnector()
    svc = service(profile_path, conn, mode="agg", min_replicas={"agg": 0})
    svc.source = DemandSource()

    async def go():
        await conn.start()
        first = await svc.woken_by_demand({"agg": 0})  # the first look: a baseline
        same = await svc.woken_by_demand({"agg": 0})  # nothing new
        svc.source.total = 3
        woke = await svc.woken_by_demand({"agg": 0})
        svc.source.total = 5
        busy = await svc.woken_by_demand({"agg": 1})  # a worker serves or starts: nothing to wake
        return first, same, woke, busy

    assert asyncio.run(go()) == (False, False, True, False)
    assert conn.calls == [(1, {"agg": 1})]
    # The woken worker is kept an interval: no step down however idle it is.
    p = svc.planner
    assert "agg" in p._demand_at

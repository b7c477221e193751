"""The planner's decisions on known numbers: observations from the frontend's own metrics
registry, the throughput path (sizing of the predicted interval, clamps), the load path (+-1 from
the engines' load reports, bounded below by the throughput path), and its config."""

from __future__ import annotations

import json
import math
import time

import pytest
from prometheus_client import generate_latest

from tests.unit.planner.test_replicas import PROFILE
from turbine.config import ConfigError
from turbine.frontend.metrics import FrontendMetrics
from turbine.planner.config import PlannerConfig, parse_planner_args
from turbine.planner.load_reports import EngineLoad, LoadReports
from turbine.planner.observe import Observation, deltas, parse_totals
from turbine.planner.planner import MEANS_WINDOW, EngineEstimate, Planner, direction, estimate
from turbine.planner.profile import PerformanceModel, write_engine_profile
from turbine.protocol.discovery import ModelCard
from turbine.protocol.load_metrics import LoadMetrics


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    write_engine_profile(PROFILE, path)
    return str(path)


def later() -> float:
    """A whole second after now: "t + 15" minus t is then exactly 15 (a monotonic clock at, say,
    508.678078343 s gives 14.999999999999943, and a step due at 15 s did not come: a flaky test)."""
    return float(math.floor(time.monotonic()) + 2)


def planner(profile_path, **kw) -> Planner:
    kw.setdefault("adjustment_interval_s", 10.0)
    kw.setdefault("predictor", "constant")
    cfg = PlannerConfig(profile=profile_path, ttft_ms=1000, itl_ms=30, **kw)
    return Planner(cfg, PerformanceModel(PROFILE))


def test_an_interval_observed_from_the_frontends_metrics():
    fm = FrontendMetrics()
    before = parse_totals(generate_latest(fm.registry).decode(), model="m")
    m, other = fm.of("m"), fm.of("other")
    for isl, osl, cached in ((1000, 200, 400), (600, 100, 100)):
        m.input_sequence.observe(isl)
        m.output_sequence.observe(osl)
        m.cached_tokens.inc(cached)
        m.ttft.observe(0.5)
    m.itl.observe(0.02)
    m.itl.observe(0.04)
    other.input_sequence.observe(99999)  # another model: not counted
    after = parse_totals(generate_latest(fm.registry).decode(), model="m")
    obs = Observation.of(10.0, deltas(before, after))
    assert obs.requests == 2 and obs.request_rate == pytest.approx(0.2)
    assert obs.isl == 800 and obs.osl == 150 and obs.kv_hit_rate == pytest.approx(500 / 1600)
    assert obs.ttft_s == pytest.approx(0.5) and obs.itl_s == pytest.approx(0.03)
    # A restarted frontend: its counters start again from zero, and count from there.
    assert deltas({"x": 10.0}, {"x": 3.0}) == {"x": 3.0}
    assert parse_totals(generate_latest(fm.registry).decode(), model=None)[
        "turbine_frontend_input_sequence_tokens_count"] == 3


def test_the_throughput_path_sizes_the_predicted_interval(profile_path):
    # 50 requests in 10 s = 5/s of ISL 1000, OSL 200, half cached: 4 prefill + 8 decode workers
    # (test_replicas.py works these out); max 6 decode.
    p = planner(profile_path, mode="disagg", fast_interval_s=0, max_replicas={"prefill": 8, "decode": 6})
    obs = Observation(seconds=10, requests=50, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    assert p.throughput_step(obs, {"prefill": 1, "decode": 1}) == {"prefill": 4, "decode": 6}
    assert p.predicted.request_rate == pytest.approx(5.0)
    # An idle interval: no requests, the means kept; the minimum of one each.
    idle = Observation(seconds=10, requests=0, isl=None, osl=None, ttft_s=None, itl_s=None, kv_hit_rate=None)
    assert p.throughput_step(idle, {"prefill": 4, "decode": 6}) == {"prefill": 1, "decode": 1}
    # A budget of 6 workers: 4 + 6 wanted, minimums 1 + 1, spare 4 shared 3:5 -> 1.5, 2.5 -> 1, 2,
    # the unit left to prefill (tie on .5: the role named first) -> 3 + 3.
    p = planner(profile_path, mode="disagg", fast_interval_s=0, max_replicas={"prefill": 8, "decode": 6},
                max_workers=6)
    assert p.throughput_step(obs, {}) == {"prefill": 3, "decode": 3}


def test_nothing_observed_yet_keeps_the_fleet_within_its_bounds(profile_path):
    p = planner(profile_path, mode="agg", fast_interval_s=0, min_replicas={"agg": 2})
    idle = Observation(seconds=10, requests=0, isl=None, osl=None, ttft_s=None, itl_s=None, kv_hit_rate=None)
    assert p.throughput_step(idle, {"agg": 1}) == {"agg": 2}
    assert p.throughput_step(idle, {"agg": 5}) == {"agg": 5}


def engine(role, running=0, waiting=0, blocks=0, name="w", at=None):
    """An engine's latest load report, received now unless `at`."""
    report = LoadMetrics(instance_id=name, kv_active_blocks=blocks, kv_total_blocks=1000, num_running=running,
                         num_waiting=waiting)
    return EngineLoad(role=role, block_size=100, report=report, at=time.monotonic() if at is None else at)


def test_load_direction_needs_every_engine_over_or_under():
    over, mid, under = (EngineEstimate("decode", None, itl, 0) for itl in (40.0, 28.0, 10.0))
    assert direction("decode", [over, over], 1000, 30, 0.8) == 1
    assert direction("decode", [over, mid], 1000, 30, 0.8) == 0
    assert direction("decode", [under, under], 1000, 30, 0.8) == -1
    assert direction("decode", [under, mid], 1000, 30, 0.8) == 0  # 28 ms is not under 0.8 x 30
    waiting = EngineEstimate("decode", None, 10.0, 3)  # fast steps, but requests wait for a slot
    assert direction("decode", [waiting, over], 1000, 30, 0.8) == 1
    assert direction("prefill", [EngineEstimate("prefill", None, 0, 9)], 1000, 30, 0.8) == 0  # no ISL seen yet
    slow_prefill = EngineEstimate("agg", 1500.0, 10.0, 2)
    fast_both = EngineEstimate("agg", 500.0, 10.0, 0)
    assert direction("agg", [slow_prefill, slow_prefill], 1000, 30, 0.8) == 1  # TTFT alone is enough to add
    assert direction("agg", [fast_both, fast_both], 1000, 30, 0.8) == -1
    assert direction("agg", [fast_both, EngineEstimate("agg", 500.0, 29.0, 0)], 1000, 30, 0.8) == 0  # ITL not under


def test_the_load_path_steps_by_one_above_the_throughput_bound(profile_path):
    p = planner(profile_path, mode="disagg", fast_interval_s=2, max_replicas={"prefill": 8, "decode": 8})
    obs = Observation(seconds=10, requests=10, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    # 1/s: prefill 1 / (4/3) -> 1; decode 1 / 0.7 -> 2. From 1 + 1 it rises to the bound at once.
    assert p.throughput_step(obs, {"prefill": 1, "decode": 1}) == {"prefill": 1, "decode": 2}
    p.decided({"prefill": 1, "decode": 2}, "throughput")
    # Decode engines: 6 running, 6 x 1100 tokens -> t = 20 + 5 x 20/7 = 34.3 ms > 30: over; their 12 requests
    # need 12 / 4 = 3 engines (one holds 0.7/s x 200 tokens x 28.57 ms = 4 at the target): +1. Prefill: 2
    # waiting, isl_eff 500 -> (2 + 1) x 500 = 1500 ms > 1000: over; 2 x 500 ms of prompts fit one TTFT: +1.
    def busy():
        return [engine("decode", running=6, blocks=66, name="d1"), engine("decode", running=6, blocks=66, name="d2"),
                engine("prefill", waiting=2, name="p1")]

    def idle():
        return [engine("decode", name=f"d{i}") for i in (1, 2, 3)] + [engine("prefill", name=f"p{i}") for i in (1, 2)]

    assert p.load_step(busy(), {"prefill": 1, "decode": 2}) == {"prefill": 2, "decode": 3}
    p.decided({"prefill": 2, "decode": 3}, "load")
    # Until every worker of a changed role has reported since the change, no further step.
    assert p.load_step(busy(), {"prefill": 2, "decode": 3}) is None  # p2 and d3 have not reported yet
    before_change = idle()
    time.sleep(0.01)
    p.decided({"prefill": 2, "decode": 3}, "load")  # no change: the clocks stay
    # All idle: -1 each, but never below the throughput path's 1 and 2.
    assert p.load_step(idle(), {"prefill": 2, "decode": 3}) == {"prefill": 1, "decode": 2}
    assert p.load_step(before_change, {"prefill": 2, "decode": 3}) == {"prefill": 1, "decode": 2}
    p.decided({"prefill": 1, "decode": 2}, "load")
    assert p.load_step(before_change, {"prefill": 1, "decode": 2}) is None  # reports older than the change
    assert p.load_step(idle(), {"prefill": 1, "decode": 2}) is None  # at the bound: no change
    # The next interval keeps what the load path added (a lower bound, not a reset).
    p.decided({"prefill": 1, "decode": 4}, "load")
    assert p.throughput_step(obs, {"prefill": 1, "decode": 4}) == {"prefill": 1, "decode": 4}


def test_load_reports_follow_only_the_planned_workers_and_their_ranks():
    reports = LoadReports()
    card = ModelCard(name="m", namespace="turbine", component="backend", endpoint="generate", instance_id="w1",
                     tokenizer_path="/x", context_length=2048, kv_block_size=64, total_kv_blocks=100,
                     max_num_seqs=8, max_num_batched_tokens=2048, disaggregation_mode="decode",
                     data_parallel_size=2)
    reports._cards = {"w1": card}  # as sync() leaves them, without opening a subscription
    reports.apply(LoadMetrics(instance_id="w1", dp_rank=1, kv_active_blocks=3, kv_total_blocks=100, num_running=2,
                              num_waiting=0), now=100.0)
    reports.apply(LoadMetrics(instance_id="w1", dp_rank=5, kv_active_blocks=3, kv_total_blocks=100, num_running=2,
                              num_waiting=0), now=100.0)
    reports.apply(LoadMetrics(instance_id="stranger", kv_active_blocks=3, kv_total_blocks=100, num_running=2,
                              num_waiting=0), now=100.0)
    assert reports.received == 1 and reports.rejected == 2
    (e,) = reports.engines(max_age_s=5, now=104.0)
    assert e.role == "decode" and e.block_size == 64 and e.report.dp_rank == 1
    assert reports.engines(max_age_s=5, now=106.0) == []  # stale


def test_config_checks_itself_and_names_the_flag(profile_path, tmp_path):
    with pytest.raises(ConfigError, match=r"--profile"):
        PlannerConfig(profile=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"--min-replicas.*not planned in mode 'agg'"):
        PlannerConfig(profile=profile_path, min_replicas={"decode": 1})
    with pytest.raises(ConfigError, match=r"--max-workers.*need 4 workers"):
        PlannerConfig(profile=profile_path, mode="disagg", min_replicas={"prefill": 2, "decode": 2}, max_workers=3)
    with pytest.raises(ConfigError, match=r"--fast-interval"):
        PlannerConfig(profile=profile_path, adjustment_interval_s=5, fast_interval_s=10)
    with pytest.raises(ConfigError, match=r"--connector-option.*takes no options"):
        PlannerConfig(profile=profile_path, connector_options={"x": "1"})
    with pytest.raises(ConfigError, match=r"--connector.*advisory"):
        PlannerConfig(profile=profile_path, connector="nonesuch")


def test_flags_override_a_config_file(profile_path, tmp_path, capsys):
    path = tmp_path / "planner.yaml"
    path.write_text(f"profile: {profile_path}\nmode: disagg\nttft-ms: 300\nmin_replicas: {{prefill: 2}}\n"
                    "max_replicas: 4\nadjustment_interval: 30\n")
    cfg = parse_planner_args(["--config", str(path), "--ttft-ms", "250", "--predictor", "kalman"])
    assert (cfg.mode, cfg.ttft_ms, cfg.predictor, cfg.adjustment_interval_s) == ("disagg", 250.0, "kalman", 30)
    assert cfg.min_replicas == {"prefill": 2} and cfg.max_replicas == {"prefill": 4, "decode": 4}
    assert cfg.minimum("decode") == 1 and cfg.roles == ("prefill", "decode")
    json_path = tmp_path / "planner.json"
    json_path.write_text(json.dumps({"profile": profile_path, "itl_ms": 20, "typo": 1}))
    with pytest.raises(SystemExit) as info:
        parse_planner_args(["--config", str(json_path)])
    assert info.value.code == 2 and "unknown setting 'typo'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_planner_args(["--profile", profile_path, "--ttft-ms", "-1"])
    assert "--ttft-ms" in capsys.readouterr().err


def test_connectors_by_name_and_the_advisory_one():
    import asyncio

    from turbine.planner.connector import AdvisoryConnector, Connector, make_connector, register_connector

    advisory = make_connector("advisory", None)
    assert isinstance(advisory, AdvisoryConnector) and isinstance(advisory, Connector)
    advisory.observe({"agg": 2})
    assert asyncio.run(advisory.current_replicas()) == {"agg": 2}
    asyncio.run(advisory.set_replicas({"agg": 3}, 7))
    assert advisory.decisions == [(7, {"agg": 3})] and asyncio.run(advisory.current_replicas()) == {"agg": 2}
    with pytest.raises(ValueError, match="unknown connector 'nope'"):
        make_connector("nope", None)
    register_connector("test-made", lambda cfg: AdvisoryConnector())
    assert isinstance(make_connector("test-made", None), AdvisoryConnector)


def test_the_turbine_command_runs_the_planner_and_names_a_bad_flag(tmp_path, capsys):
    from turbine.cli import main

    with pytest.raises(SystemExit) as info:
        main(["planner", "--profile", str(tmp_path / "none.json")])
    assert info.value.code == 2 and "--profile" in capsys.readouterr().err


def test_the_load_paths_step_up_is_sized_from_the_backlog(profile_path):
    p = planner(profile_path, mode="disagg", fast_interval_s=2, max_replicas={"prefill": 8, "decode": 8})
    obs = Observation(seconds=10, requests=10, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    assert p.throughput_step(obs, {"prefill": 1, "decode": 1}) == {"prefill": 1, "decode": 2}
    p.decided({"prefill": 1, "decode": 2}, "throughput")
    # Two decode engines with 8 requests each (over target): one holds 0.7/s x 200 x 28.57 ms = 4 at the
    # target, so the 16 need 4 engines: +2 at once (+1 would leave them over target for another start-up).
    # The prefill engine: 2 prompts queued x 500 ms = 1 s of work, within a 1 s TTFT: the least step, +1.
    engines = [engine("decode", running=8, blocks=88, name="d1"), engine("decode", running=8, blocks=88, name="d2"),
               engine("prefill", waiting=2, name="p1")]
    assert p.load_step(engines, {"prefill": 1, "decode": 2}) == {"prefill": 2, "decode": 4}


def test_one_step_up_at_most_doubles_the_role(profile_path):
    # OSL 10: one agg engine holds 1 request at the targets, so 9 waiting on one engine "need" 9 (early on,
    # the OSL is that of the short requests that finished first). One step: 1 -> 2, not 9; with 2 asked
    # for (1 still starting) and the backlog still needing more than 2: 2 -> 4.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 9}, connector="local",
                connector_options={"roles": {"agg": {}}})
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=10, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})
    queue = [engine("agg", waiting=9, name="a1")]
    assert p._backlog_need("agg", queue) == 9
    assert p.load_step(queue, {"agg": 1}) == {"agg": 2}
    p.decided({"agg": 2}, "load")
    p.changed_at.clear()  # (as if a1 reported after the change)
    assert p.load_step(queue, {"agg": 1}, starting={"agg": 1}) == {"agg": 4}


def test_the_load_path_scales_down_only_after_a_whole_start_up_under_target(profile_path):
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15)
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})  # 0.1/s: a bound of 1
    p.decided({"agg": 3}, "load")
    time.sleep(0.01)
    # Under target, one request each (one engine holds 0.4/s x 200 x 30 ms = 2.4 at the targets: the 3
    # need 2, no surplus to halve), reported after the change.
    idle = [engine("agg", running=1, name=f"a{i}") for i in (1, 2, 3)]
    t0 = later()
    assert p.load_step(idle, {"agg": 3}, now=t0) is None  # under target: the clock starts
    assert p.load_step(idle, {"agg": 3}, now=t0 + 14) is None  # a dip shorter than a start-up: kept
    assert p.load_step(idle, {"agg": 3}, now=t0 + 15) == {"agg": 2}
    p.decided({"agg": 2}, "load")
    time.sleep(0.01)
    idle = [engine("agg", running=1, name=f"a{i}") for i in (1, 2)]
    t1 = later()
    assert p.load_step(idle, {"agg": 2}, now=t1) is None  # after a step down the clock starts again
    busy = [engine("agg", waiting=1, name=n) for n in ("a1", "a2")]
    assert p.load_step(busy, {"agg": 2}, now=t1 + 10) == {"agg": 3}  # over target: up at once, clock reset
    p.decided({"agg": 2}, "load")  # (the step up not applied here)
    assert p.load_step(idle, {"agg": 2}, now=t1 + 16) is None  # under again since t1 + 16 only


def test_the_throughput_path_counts_arrivals_not_only_finished_requests(profile_path):
    p = planner(profile_path, mode="agg", fast_interval_s=0, max_replicas={"agg": 50})
    obs = Observation(seconds=10, requests=10, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    assert p.arrival_rate(obs, None) == pytest.approx(1.0)  # nothing known in the engines: the finished rate
    assert p.arrival_rate(obs, 4) == pytest.approx(1.0)  # the first count: no change known yet
    # 10 finished while the engines went from 4 to 24 requests: 30 arrived in 10 s (saturated engines
    # finish what they can; the finished rate alone would say 1/s).
    p.throughput_step(obs, {"agg": 1}, in_system=24)
    assert p.predicted.request_rate == pytest.approx(3.0)
    assert p.arrival_rate(obs, 4) == pytest.approx(0.0)  # 10 finished, 20 fewer in the engines: none arrived


def test_the_throughput_path_sizes_for_a_share_of_the_targets(profile_path):
    # 1 request/s of ISL 1000 (half cached), OSL 200, agg: at the targets (1000 ms, 30 ms) one engine takes
    # 0.4/s (test_replicas.py) -> 3; at 0.8 x them (800 ms, 24 ms): ITL = (120/7) / (1 - (15/14) lam) <= 24
    # -> lam <= 4/15 per second -> 3.75 -> 4 engines.
    obs = Observation(seconds=10, requests=10, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    at_targets = planner(profile_path, mode="agg", fast_interval_s=0, max_replicas={"agg": 8})
    assert at_targets.throughput_step(obs, {"agg": 1}) == {"agg": 3}
    shared = planner(profile_path, mode="agg", fast_interval_s=0, max_replicas={"agg": 8}, target_share=0.8)
    assert shared.throughput_step(obs, {"agg": 1}) == {"agg": 4}
    assert shared.last_sizing.agg.requests_per_s == pytest.approx(4 / 15, rel=1e-6)
    with pytest.raises(ConfigError, match="target_share"):
        planner(profile_path, target_share=0)


def test_the_per_request_means_are_pooled_over_the_last_intervals_requests(profile_path):
    # The first three intervals of a benchmark run: ISL 739, 469, 97 over 5, 10 and 4 requests. A trend
    # model forecast an ISL of 0 from them (Kalman); the pooled mean is what those 19 requests had.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, predictor="kalman")
    for n, isl, osl, hit in ((5, 739, 51, 0.0), (10, 469, 91, 0.2), (4, 97, 120, 0.5)):
        p.throughput_step(Observation(seconds=10, requests=n, isl=isl, osl=osl, ttft_s=0.4, itl_s=0.02,
                                      kv_hit_rate=hit), {"agg": 1})
    isl_tokens = 5 * 739 + 10 * 469 + 4 * 97
    assert p.predicted.isl == pytest.approx(isl_tokens / 19)
    assert p.predicted.osl == pytest.approx((5 * 51 + 10 * 91 + 4 * 120) / 19)
    assert p.predicted.kv_hit_rate == pytest.approx((10 * 469 * 0.2 + 4 * 97 * 0.5) / isl_tokens)
    # An idle interval keeps them; the window holds the last MEANS_WINDOW intervals with requests.
    p.throughput_step(Observation(seconds=10, requests=0, isl=None, osl=None, ttft_s=None, itl_s=None,
                                  kv_hit_rate=None), {"agg": 1})
    assert p.predicted.isl == pytest.approx(isl_tokens / 19)
    for _ in range(MEANS_WINDOW):
        p.throughput_step(Observation(seconds=10, requests=3, isl=300, osl=80, ttft_s=0.4, itl_s=0.02,
                                      kv_hit_rate=0.1), {"agg": 1})
    assert (p.predicted.isl, p.predicted.osl) == pytest.approx((300, 80))


def test_the_throughput_path_keeps_a_square_root_spare(profile_path):
    # 1 request/s, one engine takes 0.4/s at the targets: R = 2.5 -> 3 engines; --sqrt-staffing 1:
    # 2.5 + sqrt(2.5) = 4.08 -> 5, the bound; what the load path keeps from the recent rate has no spare (3).
    obs = Observation(seconds=10, requests=10, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02, kv_hit_rate=0.5)
    spare = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, sqrt_staffing=1.0)
    assert spare.throughput_step(obs, {"agg": 1}) == {"agg": 5}
    assert spare.lower == {"agg": 5} and spare.keep == {"agg": 3}
    assert parse_planner_args(["--profile", profile_path, "--sqrt-staffing", "0.5"]).sqrt_staffing == 0.5
    with pytest.raises(ConfigError, match="sqrt_staffing"):
        planner(profile_path, sqrt_staffing=-1)


def test_a_surplus_of_the_role_as_a_whole_counts_as_under_target(profile_path):
    # 6 engines, one with a prompt waiting (so not every engine is under target, nor every one over),
    # 3 requests in all: one engine holds 2.4 at the targets, the backlog needs 2 of the 6. After a whole
    # start-up of that: half the surplus, -2.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15)
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})  # 0.1/s: a bound of 1
    p.decided({"agg": 6}, "load")
    time.sleep(0.01)
    mixed = [engine("agg", waiting=1, name="a0")] + [engine("agg", running=1 if i < 3 else 0, name=f"a{i}")
                                                     for i in range(1, 6)]
    t0 = later()
    assert p.load_step(mixed, {"agg": 6}, now=t0) is None
    assert p.load_step(mixed, {"agg": 6}, now=t0 + 15) == {"agg": 4}
    # Mixed engines whose backlog needs all but one of them (10 requests: 5 engines): no step down.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15)
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})
    p.decided({"agg": 6}, "load")
    time.sleep(0.01)
    held = [engine("agg", waiting=1, name="a0")] + [engine("agg", running=2 if i < 5 else 1, name=f"a{i}")
                                                    for i in range(1, 6)]
    t0 = later()
    assert p.load_step(held, {"agg": 6}, now=t0) is None
    assert p.load_step(held, {"agg": 6}, now=t0 + 15) is None


def test_a_backlog_the_role_cannot_hold_adds_though_not_every_engine_is_over(profile_path):
    # 3 engines, one under target: 11 requests in them need 11 / 2.4 -> 5 engines at the targets: +2.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8})
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})
    p.decided({"agg": 3}, "load")
    time.sleep(0.01)
    engines = [engine("agg", running=6, blocks=66, name="a1"), engine("agg", running=4, blocks=44, name="a2"),
               engine("agg", running=1, name="a3")]
    assert direction("agg", [estimate(e, p.model, p.isl_eff()) for e in engines], 1000, 30, 0.8) == 0
    assert p.load_step(engines, {"agg": 3}) == {"agg": 5}


def test_the_load_path_removes_half_the_surplus_at_a_time(profile_path):
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15)
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})  # 0.1/s: a bound of 1
    p.decided({"agg": 8}, "load")
    time.sleep(0.01)
    # 8 engines, 2 requests in all (one engine holds 2.4 at the targets: 1 needed): surplus 7, -4 -> 4.
    idle = [engine("agg", running=1 if i < 2 else 0, name=f"a{i}") for i in range(8)]
    t0 = later()
    assert p.load_step(idle, {"agg": 8}, now=t0) is None
    assert p.load_step(idle, {"agg": 8}, now=t0 + 15) == {"agg": 4}


def test_the_load_path_keeps_what_the_last_start_ups_highest_rate_needs(profile_path):
    # Start-up 15 s, intervals 10 s: the last 1 + 2 intervals count. 1/s then 0.1/s twice: the forecast
    # (constant) says 0.1/s (a bound of 1), but 1/s was seen within a start-up: 3 engines kept
    # (test_the_throughput_path_sizes_for_a_share_of_the_targets), however idle they are now.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 8}, startup_s=15)
    for n in (10, 1, 1):
        p.throughput_step(Observation(seconds=10, requests=n, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                      kv_hit_rate=0.5), {"agg": 1})
    assert p.lower == {"agg": 1} and p.keep == {"agg": 3}
    p.decided({"agg": 8}, "load")
    time.sleep(0.01)
    idle = [engine("agg", name=f"a{i}") for i in range(8)]
    t0 = later()
    assert p.load_step(idle, {"agg": 8}, now=t0) is None
    assert p.load_step(idle, {"agg": 8}, now=t0 + 15) == {"agg": 4}  # half the surplus
    p.decided({"agg": 4}, "load")
    time.sleep(0.01)
    idle = [engine("agg", name=f"a{i}") for i in range(4)]  # reports after the change
    t1 = later()
    assert p.load_step(idle, {"agg": 4}, now=t1) is None
    assert p.load_step(idle, {"agg": 4}, now=t1 + 15) == {"agg": 3}  # not 2: `keep`
    p.decided({"agg": 3}, "load")
    time.sleep(0.01)
    idle = [engine("agg", name=f"a{i}") for i in range(3)]
    t2 = later()
    assert p.load_step(idle[:3], {"agg": 3}, now=t2) is None
    assert p.load_step(idle[:3], {"agg": 3}, now=t2 + 15) is None
    # Once 1/s is older than a start-up: down to the bound.
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 3})
    assert p.keep == {"agg": 1}


def test_requests_queued_at_the_frontend_count_in_the_backlog_and_hold_off_a_step_down(profile_path):
    # The frontend's busy thresholds (turbine/frontend/models/busy_queue.py) keep requests from the engines: the
    # engines look under target while requests wait for them.
    p = planner(profile_path, mode="agg", fast_interval_s=2, max_replicas={"agg": 9}, startup_s=15)
    p.throughput_step(Observation(seconds=10, requests=1, isl=1000, osl=200, ttft_s=0.4, itl_s=0.02,
                                  kv_hit_rate=0.5), {"agg": 1})  # one engine holds ~2.2 at the targets
    p.decided({"agg": 3}, "load")
    time.sleep(0.01)
    idle = [engine("agg", running=1, name=f"a{i}") for i in (1, 2, 3)]
    assert p._backlog_need("agg", idle) == 2 and p._backlog_need("agg", idle, queued=9) == 6
    t0 = later()
    assert p.load_step(idle, {"agg": 3}, now=t0, queued=4) is None
    assert p.load_step(idle, {"agg": 3}, now=t0 + 20, queued=4) is None  # requests wait: no step down
    assert p.load_step(idle, {"agg": 3}, now=t0 + 21, queued=9) == {"agg": 6}  # sized from engines + queue
    text = generate_latest(metrics_with_queue()).decode()
    from turbine.planner.observe import parse_queued
    assert parse_queued(text, None) == 5 and parse_queued(text, "m") == 3 and parse_queued(text, "x") == 0


def metrics_with_queue():
    m = FrontendMetrics()
    m.of("m").queued.set(3)
    m.of("n").queued.set(2)
    return m.registry

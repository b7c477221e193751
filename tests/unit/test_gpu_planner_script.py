"""The GPU ramp of the planner's disaggregated mode (benchmarks/gpu/gpu_planner.py, issue #30 §3) as far as a CPU host
checks it without processes: its ramp and flags, a synthetic profile under which the planner's own maths want one
decode worker at the low rate and two at the high one, a planner config the planner and its local connector accept
(each role pinned to its GPU), and what it reads back from the planner's log and its samples. (`--engine mocker`
runs the whole flow on simulated workers.)"""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from benchmarks.gpu import gpu_planner
from turbine.planner.config import parse_planner_args
from turbine.planner.connectors.local import OWN_FLAGS, LocalConnectorConfig
from turbine.planner.profile import PerformanceModel, load_engine_profile
from turbine.planner.replicas import Load, size


def test_the_ramp_is_parsed_and_its_arrivals_stay_in_their_phases():
    phases = gpu_planner.parse_phases("low:20,high:10,2.5:4", low_rps=1.0, high_rps=8.0)
    assert [(p.name, p.rps, p.seconds) for p in phases] == [("low", 1.0, 20.0), ("high", 8.0, 10.0), ("2.5", 2.5, 4.0)]
    for bad in ("low", "low:0", "fast:10", "low:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_planner.parse_phases(bad, 1.0, 8.0)
    a = gpu_planner.parse_args(["--engine", "mocker", "--phases", "low:20,high:10,low:5", "--seed", "3"])
    plan = gpu_planner.arrivals(a)
    assert plan == gpu_planner.arrivals(a)  # the same schedule every run
    bounds = [(0, 20), (20, 30), (30, 35)]
    assert all(bounds[k][0] <= at < bounds[k][1] for at, k in plan)
    assert 40 <= sum(k == 1 for _, k in plan) <= 130  # ~80 at 8/s for 10 s


def test_flags_that_could_not_make_the_planner_scale_are_refused(capsys):
    for argv in (["--engine", "mocker", "--decode-capacity", "0.5"],  # below the low rate: two decoders even there
                 ["--engine", "mocker", "--decode-capacity", "9"],  # above the high rate: one is enough
                 ["--engine", "mocker", "--max-decode", "1"],
                 ["--load-format", "dummy"]):  # vllm needs the model folder
        with pytest.raises(SystemExit):
            gpu_planner.parse_args(argv)
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "/models/llama", "--load-format", "dummy"],
                                  ["--engine", "mocker", "--low-rps", "0.5", "--high-rps", "3", "--isl", "256",
                                   "--osl", "64"]])
def test_the_synthetic_profile_wants_one_decode_worker_at_the_low_rate_and_two_at_the_high(argv, tmp_path):
    a = gpu_planner.parse_args(argv)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(gpu_planner.synthetic_profile(a)))
    model = PerformanceModel(load_engine_profile(path))
    low, high = (size("disagg", model, Load(rate, a.isl, a.osl), a.ttft_ms, a.itl_ms) for rate in (a.low_rps,
                                                                                                 a.high_rps))
    assert low.replicas == {"prefill": 1, "decode": 1} and high.replicas == {"prefill": 1, "decode": 2}
    assert high.decode.reachable and high.decode.requests_per_s == pytest.approx(a.decode_capacity, rel=0.1)


@pytest.mark.parametrize("engine", ["vllm", "mocker"])
@pytest.mark.parametrize("pool", [1, 0])
def test_the_planner_and_its_local_connector_accept_the_config_each_role_on_its_gpu(engine, pool, tmp_path):
    a = gpu_planner.parse_args(["--engine", engine, "--model", "/models/llama", "--load-format", "dummy",
                                "--sleep-pool", str(pool)])
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(gpu_planner.synthetic_profile(a)))
    cfg = gpu_planner.planner_config(a, tmp_path, str(profile), "http://127.0.0.1:8000", 0)
    (tmp_path / "planner.yaml").write_text(yaml.safe_dump(cfg))
    planner = parse_planner_args(["--config", str(tmp_path / "planner.yaml")])
    assert (planner.mode, planner.connector) == ("disagg", "local")
    assert planner.min_replicas == {"prefill": 1, "decode": 1} and planner.max_replicas == {"prefill": 1, "decode": 2}
    assert planner.max_workers == 3  # never more workers than the two GPUs were sized for
    local = LocalConnectorConfig.from_dict(planner.connector_options)
    assert local.sleep_pool == pool
    assert {r: spec.env["CUDA_VISIBLE_DEVICES"] for r, spec in local.roles.items()} == {"prefill": "0", "decode": "1"}
    for role, spec in local.roles.items():
        assert spec.engine == engine and not {x.split("=")[0] for x in spec.args} & set(OWN_FLAGS)
        if engine == "vllm":
            assert "--connector" in spec.args and spec.args[spec.args.index("--connector") + 1] == "nixl"
            assert ("--enable-sleep-mode" in spec.args) == (role == "decode" and pool > 0)
        else:  # the simulated engine runs the planner's profile
            assert spec.args[spec.args.index("--profile") + 1] == str(profile)


def test_decisions_and_the_connectors_actions_are_read_from_the_planners_log():
    log = "\n".join([
        "2026-11-30 02:40:05,120 INFO turbine.planner: decision 1 (startup path): {'prefill': 0, 'decode': 0} -> "
        "{'prefill': 1, 'decode': 1}; predicted None",
        "2026-11-30 02:40:16,916 INFO turbine.planner: interval: 0.80 requests/s, ISL 256, OSL 64",
        "2026-11-30 02:41:07,960 INFO turbine.planner: decision 3 (load path): {'prefill': 1, 'decode': 2} -> "
        "{'prefill': 1, 'decode': 1}; predicted Load(request_rate=1.6)",
        "2026-11-30 02:41:07,972 INFO turbine.planner.local: decision 3: decode 2 -> 1, sleeping decode-3 (load 0)",
        "2026-11-30 02:41:08,345 INFO turbine.planner.local: decode-3 (pid 20098) asleep (level 1) after 0.41s",
        "2026-11-30 02:41:09,000 INFO turbine.planner: load path: decode -1 from 2"])
    events = gpu_planner.planner_events(log)
    assert [(d["id"], d["path"], d["to"]) for d in events["decisions"]] == [
        (1, "startup", "{'prefill': 1, 'decode': 1}"), (3, "load", "{'prefill': 1, 'decode': 1}")]
    first, second = events["actions"]  # the connector's lines; not the planner's own decision or load-path lines
    assert "sleeping decode-3" in first and "asleep (level 1)" in second
    assert len(events["intervals"]) == 1


def sample(t, ready, frontend=None):
    return {"t": t, "phase": "x", "inflight": 0, "decision_id": 0, "asleep": [],
            "current": {"prefill": 1, "decode": ready}, "starting": {"prefill": 0, "decode": 0},
            "sleeping": {"prefill": 0, "decode": 0}, "target": {"prefill": 1, "decode": ready},
            "frontend": {"prefill": 1, "decode": ready if frontend is None else frontend}}


def test_the_checks_need_nothing_lost_a_second_decoder_serving_and_the_role_back_down():
    a = gpu_planner.parse_args(["--engine", "mocker"])
    served = {"metrics": {"requests": {"success": 3.0}}}
    doc = {"series": [sample(0, 1), sample(1, 2), sample(2, 1)],
           "requests": {"sent": 10, "lost": 0},
           "workers": {"1": {"role": "decode", **served}, "2": {"role": "decode", **served},
                       "3": {"role": "prefill", **served}},
           "frontend": {"prefills": {"remote": 10.0}}}
    assert all(gpu_planner.checks(a, doc).values())
    lost = dict(doc, requests={"sent": 10, "lost": 1})
    assert gpu_planner.checks(a, lost)["no request lost"] is False
    never_down = dict(doc, series=[sample(0, 1), sample(1, 2)])
    assert gpu_planner.checks(a, never_down)["decode scaled down after the peak"] is False
    idle_second = dict(doc, workers={**doc["workers"], "2": {"role": "decode", "metrics": {"requests": {}}}})
    assert gpu_planner.checks(a, idle_second)["decode scaled up (a second decode worker served)"] is False
    assert gpu_planner.whole({"finish_reason": "length", "completion_tokens": 8, "ids": ["a"]}, 8)
    assert not gpu_planner.whole({"finish_reason": "length", "completion_tokens": 8, "ids": ["a", "b"]}, 8)

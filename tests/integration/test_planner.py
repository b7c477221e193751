"""The planner process against a real frontend and simulated workers, in advisory mode: it
registers in discovery, says "starting" until the frontend answers, reads traffic from the
frontend's /metrics and load from the workers' reports on the event plane, and decides:
- under a steady driven load, the throughput path's count is what the replica maths give for the
  traffic it predicted (the maths themselves: tests/unit/planner/test_replicas.py), above the 2
  workers running;
- in a burst that queues requests on every worker, the load path adds workers (a step sized from the queue);
- when traffic stops, the load path brings the target down to the minimum.
Advisory: every decision is logged and the fleet is never changed. The profile comes from
`turbine profile` run against the same workers. No vLLM engine runs here."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.procs import (
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    prefill_workers_of,
    start_frontend,
    start_mocker,
    start_planner,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.config import DiscoveryConfig, make_registry
from turbine.model.prepare import DEFAULT_MODEL
from turbine.planner.profile import PerformanceModel, load_engine_profile
from turbine.planner.replicas import Load, clamp, size

MODEL = DEFAULT_MODEL
# A worker whose lone 200-token prompt takes ~410 ms: at 4 requests/s a TTFT of 1 s needs about 3.
TIMING = '{"step_base_ms": 10, "prefill_ms_per_token": 2, "decode_ms_per_seq": 1, "decode_ms_per_kv_token": 0.001}'
TTFT_MS, ITL_MS = 1000, 30
ISL, OSL = 200, 20


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def gauge(text: str, name: str, **labels) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner")
    env = base_env(str(root / "discovery"))
    (root / "timing.json").write_text(TIMING)
    workers = start_mocker("planner-mockers", env, root, "--num-workers", "2", "--profile", str(root / "timing.json"),
                           "--natural-output-len", "0", "--max-num-batched-tokens", "2048")
    frontend_port = free_port()
    planner_port = free_port()
    procs = [workers]
    try:
        wait_until(lambda: worker_ready(workers), 60, "mockers ready", procs)
        profile = root / "profile.json"  # the planner's profile: `turbine profile` sweeps a live worker
        result = subprocess.run(
            [sys.executable, "-m", "turbine.cli", "profile", "--model", MODEL, "--output", str(profile),
             "--prompt-lens", "64,256,768", "--repeats", "1", "--batch-sizes", "1,4,12", "--decode-prompt-lens",
             "64,512", "--decode-tokens", "16", "--cached-prefix-lens", "256"],
            env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        planner = advisory_planner(env, root, profile, planner_port, frontend_port)
        procs.append(planner)
        yield {"env": env, "root": root, "workers": workers, "planner": planner, "profile": profile,
               "frontend_port": frontend_port, "procs": procs}
    finally:
        stop_all(procs)


def advisory_planner(env, root, profile, port, frontend_port):
    return start_planner("planner", env, root, "--profile", str(profile), "--mode", "agg", "--model", MODEL,
                         "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS), "--adjustment-interval", "4",
                         "--fast-interval", "1", "--predictor", "constant", "--advisory",
                         "--frontend-url", f"http://127.0.0.1:{frontend_port}", "--max-replicas", "10", port=port)


def drive(client: OpenAI, rate: float, seconds: float, isl: int, osl: int) -> int:
    """Open-loop requests at `rate` per second for `seconds`; returns how many succeeded."""
    rng = random.Random(1)

    def one(_):
        prompt = [rng.randrange(1000, 40000) for _ in range(isl)]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=osl, extra_body={"ignore_eos": True})
        return 1

    with ThreadPoolExecutor(48) as pool:
        futures = []
        started = time.monotonic()
        for i in range(int(rate * seconds)):
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
            futures.append(pool.submit(one, i))
        return sum(f.result() for f in futures)


def test_the_planner_registers_and_waits_for_the_frontend(stack):
    planner = stack["planner"]
    wait_until(lambda: http_json(f"{planner.url}/live")[0] == 200, 30, "planner live", [planner])
    status, body = http_json(f"{planner.url}/health")
    assert status == 503 and body["status"] == "starting"  # no frontend yet
    time.sleep(1.5)
    assert "waiting for the frontend's metrics" in planner.log_tail()

    async def planner_records():
        registry = make_registry(DiscoveryConfig(backend="file", file_dir=stack["env"]["TURBINE_DISCOVERY_DIR"]))
        await registry.backend.start()
        try:
            return [r for r in await registry.list_instances() if r.component == "planner"]
        finally:
            await registry.backend.close()

    (record,) = asyncio.run(planner_records())
    assert record.endpoint == "status" and record.address == f"127.0.0.1:{planner.port}"
    frontend = start_frontend("planner-frontend", stack["env"], stack["root"], port=stack["frontend_port"])
    stack["procs"].append(frontend)
    stack["frontend"] = frontend
    wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees the workers", [frontend])
    wait_until(lambda: http_json(f"{planner.url}/health")[0] == 200, 30, "planner healthy", [planner])
    assert http_json(f"{planner.url}/health")[1]["workers"] == {"agg": 2}


def test_advisory_decisions_follow_the_load_and_change_nothing(stack):
    planner, frontend = stack["planner"], stack["frontend"]
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = PerformanceModel(load_engine_profile(stack["profile"]))

    # Steady load: the throughput path sizes what it predicted (constant: the last interval).
    assert drive(client, rate=4, seconds=12, isl=ISL, osl=OSL) == 48
    text = http_text(f"{planner.url}/metrics")
    predicted = Load(request_rate=gauge(text, "turbine_planner_predicted", quantity="request_rate"),
                     isl=gauge(text, "turbine_planner_predicted", quantity="isl"),
                     osl=gauge(text, "turbine_planner_predicted", quantity="osl"),
                     kv_hit_rate=gauge(text, "turbine_planner_predicted", quantity="kv_hit_rate"))
    assert predicted.isl == pytest.approx(ISL, abs=1) and predicted.osl == pytest.approx(OSL, abs=1)
    assert predicted.request_rate > 2  # about 4/s, as the frontend counted finished requests
    expected = clamp(size("agg", model, predicted, TTFT_MS, ITL_MS).replicas, {"agg": 1}, {"agg": 10}, None)["agg"]
    assert gauge(text, "turbine_planner_throughput_replicas", role="agg") == expected
    assert expected > 2, f"the load should need more than the 2 workers running (predicted {predicted})"
    assert gauge(text, "turbine_planner_target_replicas", role="agg") >= expected  # the load path may add more
    assert gauge(text, "turbine_planner_decision_id") >= 1

    # Idle: the throughput path's bound falls to the minimum, and the load path, every engine
    # under target, steps the target down to it (advisory: one below the 2 workers running).
    wait_until(lambda: gauge(http_text(f"{planner.url}/metrics"), "turbine_planner_target_replicas",
                             role="agg") == 1, 60, "the target down to the minimum", [planner])
    text = http_text(f"{planner.url}/metrics")
    assert gauge(text, "turbine_planner_decisions_total", path="load", role="agg", direction="down") >= 1
    assert gauge(text, "turbine_planner_engine_estimate_ms", role="agg", quantity="itl") is not None  # load reports

    # A burst of long prompts queues requests on both workers (2 of 1000 tokens per step): before
    # they finish (the throughput path sees none yet), the load path adds to the 2 running: a step sized
    # from the 12 requests queued (at least one).
    ups = gauge(text, "turbine_planner_decisions_total", path="load", role="agg", direction="up") or 0
    with ThreadPoolExecutor(1) as pool:
        burst = pool.submit(drive, client, 12, 1, 1000, 4)
        wait_until(lambda: gauge(http_text(f"{planner.url}/metrics"), "turbine_planner_decisions_total",
                                 path="load", role="agg", direction="up") == ups + 1, 30,
                   "a load-path scale-up during the burst", [planner])
        step = re.search(r"\(load path\): \{'agg': 2\} -> \{'agg': (\d+)\}", planner.log_tail(400))
        assert step and int(step.group(1)) >= 3, planner.log_tail(400)
        assert burst.result() == 12

    # Advisory: logged, never applied.
    assert "advisory: decision" in planner.log_tail(400)
    assert instances_of(frontend, MODEL) == 2
    assert gauge(http_text(f"{planner.url}/metrics"), "turbine_planner_current_replicas", role="agg") == 2


def test_disaggregated_roles_are_planned_apart(tmp_path):
    """Prefill and decode workers (simulated) behind a frontend: the planner in disagg mode counts
    each role from its workers' cards and sizes both from the traffic it observed."""
    from tests.unit.planner.test_replicas import PROFILE
    from turbine.planner.profile import write_engine_profile

    env = base_env(str(tmp_path / "discovery"))
    profile = tmp_path / "profile.json"
    write_engine_profile(PROFILE, profile)
    prefill = start_mocker("disagg-prefill", env, tmp_path, "--disaggregation-mode", "prefill", "--speedup-ratio", "0")
    decode = start_mocker("disagg-decode", env, tmp_path, "--disaggregation-mode", "decode", "--speedup-ratio", "0")
    frontend = start_frontend("disagg-frontend", env, tmp_path)
    planner = start_planner("disagg-planner", env, tmp_path, "--profile", str(profile), "--mode", "disagg",
                            "--model", MODEL, "--ttft-ms", "1000", "--itl-ms", "30", "--adjustment-interval", "3",
                            "--fast-interval", "0", "--predictor", "constant", "--advisory",
                            "--frontend-url", frontend.url, "--max-replicas", "prefill=20,decode=20")
    procs = [prefill, decode, frontend, planner]
    try:
        wait_until(lambda: http_json(f"{planner.url}/health")[0] == 200, 60, "planner healthy", procs)
        assert http_json(f"{planner.url}/health")[1]["workers"] == {"prefill": 1, "decode": 1}
        # The planner reads discovery; the frontend's own view of the workers may come a moment
        # later, and a request before it is a 404 (seen in CI).
        wait_until(lambda: instances_of(frontend, MODEL) == 1 and prefill_workers_of(frontend, MODEL) == 1, 30,
                   "frontend sees both workers", procs)
        client = OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = PerformanceModel(load_engine_profile(profile))

        def sized() -> bool:
            drive(client, rate=10, seconds=1, isl=1000, osl=200)
            text = http_text(f"{planner.url}/metrics")
            rate = gauge(text, "turbine_planner_predicted", quantity="request_rate")
            if not rate or gauge(text, "turbine_planner_predicted", quantity="isl") != 1000:
                return False
            load = Load(rate, 1000, gauge(text, "turbine_planner_predicted", quantity="osl"),
                        gauge(text, "turbine_planner_predicted", quantity="kv_hit_rate"))
            want = clamp(size("disagg", model, load, 1000, 30).replicas, {"prefill": 1, "decode": 1},
                         {"prefill": 20, "decode": 20}, None)
            return (gauge(text, "turbine_planner_throughput_replicas", role="prefill") == want["prefill"]
                    and gauge(text, "turbine_planner_throughput_replicas", role="decode") == want["decode"]
                    and want["decode"] > 1)
        wait_until(sized, 60, "both roles sized from the observed traffic", procs)
    finally:
        stop_all(procs)

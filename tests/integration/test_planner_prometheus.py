"""The planner's traffic from a real Prometheus server (Debian's prometheus, started here with a
private config that scrapes the frontend every second) instead of the frontend's /metrics: the
same interval read both ways agrees, and a planner given --prometheus-url plans from it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    start_frontend,
    start_mocker,
    start_planner,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.integration.test_planner import gauge
from tests.unit.planner.test_replicas import PROFILE
from turbine.model.prepare import DEFAULT_MODEL
from turbine.planner.observe import FrontendScraper, PrometheusSource
from turbine.planner.profile import write_engine_profile

MODEL = DEFAULT_MODEL
PROMETHEUS_HINT = "install Debian's prometheus (apt-get install -y prometheus); scripts/run_tests.sh does"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner-prometheus")
    env = base_env(str(root / "discovery"))
    binary = shutil.which("prometheus")
    assert binary, PROMETHEUS_HINT
    workers = start_mocker("prom-mockers", env, root, "--num-workers", "2", "--speedup-ratio", "0")
    frontend = start_frontend("prom-frontend", env, root)
    prom_port = free_port()
    (root / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: frontend, static_configs: [{{targets: ['127.0.0.1:{frontend.port}']}}]}}]\n")
    prom = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=open(root / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    procs = [workers, frontend]
    try:
        wait_until(lambda: worker_ready(workers), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees the workers", procs)
        url = f"http://127.0.0.1:{prom_port}"
        wait_until(lambda: "Ready" in http_text(f"{url}/-/ready"), 30, "prometheus ready", procs)
        wait_until(lambda: '"health":"up"' in http_text(f"{url}/api/v1/targets"), 30, "prometheus scrapes", procs)
        yield {"env": env, "root": root, "frontend": frontend, "prometheus": url, "procs": procs}
    finally:
        prom.terminate()
        prom.wait(30)
        stop_all(procs)


def test_prometheus_and_the_frontend_give_the_same_interval(stack):
    client = OpenAI(base_url=f"{stack['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=60)

    # A series Prometheus first sees already counting has no increase(): one request first, so the
    # model's series exist before the window (the frontend makes them at a model's first request).
    client.completions.create(model=MODEL, prompt=[1000, 1001], max_tokens=1)

    async def both():
        scraper = FrontendScraper(stack["frontend"].url, MODEL)
        source = PrometheusSource(stack["prometheus"], MODEL)
        await asyncio.sleep(3)  # two scrapes: Prometheus holds the warm-up before the interval starts
        await scraper.start()
        await source.start()
        for n in (100, 300):
            await asyncio.to_thread(client.completions.create, model=MODEL, prompt=[1000 + i for i in range(n)],
                                    max_tokens=10, extra_body={"ignore_eos": True})
        await asyncio.sleep(2.5)  # two scrapes later Prometheus holds the new values
        direct = await scraper.observe(0)
        via_prometheus = await source.observe(0)  # both: since their start
        await scraper.close()
        await source.close()
        return direct, via_prometheus

    direct, via = asyncio.run(both())
    assert direct.requests == 2 and direct.isl == 200 and direct.osl == 10
    assert via.requests == 2 and via.isl == 200 and via.osl == 10
    assert via.ttft_s == pytest.approx(direct.ttft_s, rel=0.05)


def test_a_planner_with_prometheus_url_plans_from_it(stack):
    profile = stack["root"] / "profile.json"
    write_engine_profile(PROFILE, profile)
    planner = start_planner("prom-planner", stack["env"], stack["root"], "--profile", str(profile), "--model", MODEL,
                            "--adjustment-interval", "3", "--fast-interval", "0", "--predictor", "constant",
                            "--advisory", "--prometheus-url", stack["prometheus"],
                            "--frontend-url", "http://127.0.0.1:9")  # never read: Prometheus is the source
    stack["procs"].append(planner)
    client = OpenAI(base_url=f"{stack['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=60)
    wait_until(lambda: http_json(f"{planner.url}/health")[0] == 200, 30, "planner healthy", [planner])

    def planned() -> bool:
        client.completions.create(model=MODEL, prompt=[1000 + i for i in range(400)], max_tokens=8,
                                  extra_body={"ignore_eos": True})
        isl = gauge(http_text(f"{planner.url}/metrics"), "turbine_planner_observed", quantity="isl")
        return isl is not None and abs(isl - 400) < 1
    wait_until(planned, 40, "an interval read from Prometheus", [planner])

"""The planner's local connector on real vLLM CPU workers (issue #17): one scale-up and one drained
scale-down under a steady stream of streamed requests through the real frontend (the official openai
client), counting failed requests. A benchmark rather than a test: on this 2-core host a second vLLM
engine takes 1-4 minutes to start while the first serves (more when the host is shared).

    flock /tmp/turbine-engine.lock .venv/bin/python -m benchmarks.planner.planner_local_vllm \\
        --out benchmarks/results/planner/planner_local_vllm-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.integration.planner_traffic import SteadyTraffic
from tests.integration.procs import ENGINE_FLAGS, free_port, metric
from turbine.config import DiscoveryConfig
from turbine.model.prepare import DEFAULT_MODEL
from turbine.planner.connectors.local import LocalConnector, LocalConnectorConfig, LocalRole


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def instances(fe_url: str) -> int:
    try:
        return json.loads(get(f"{fe_url}/health")).get("models", {}).get(DEFAULT_MODEL, 0)
    except OSError:
        return 0


async def until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await cond():
            return time.monotonic() - t0
        await asyncio.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


async def run(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="turbine-planner-vllm-"))
    disc = work / "discovery"
    port = free_port()
    fe_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, TURBINE_DISCOVERY_BACKEND="file", TURBINE_DISCOVERY_DIR=str(disc),
               TURBINE_DISCOVERY_TTL="3", PYTHONUNBUFFERED="1")
    frontend = subprocess.Popen([sys.executable, "-m", "turbine.frontend", "--http-port", str(port),
                                 "--migration-limit", "2"], env=env, stdout=open(work / "frontend.log", "wb"),
                                stderr=subprocess.STDOUT)
    cfg = LocalConnectorConfig(roles={"agg": LocalRole("vllm", tuple(ENGINE_FLAGS),
                                                       {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"})},
                               discovery=DiscoveryConfig(backend="file", file_dir=str(disc), ttl=3.0),
                               log_dir=str(work / "workers"), drain_timeout=a.drain_timeout)
    conn = LocalConnector(cfg)
    await conn.start()
    out: dict = {"work_dir": str(work), "drain_timeout_s": a.drain_timeout}
    traffic = None

    async def registered(n):
        return (await conn.current_replicas())["agg"] >= n

    async def truthy(f):
        return f()

    try:
        await conn.set_replicas({"agg": 1}, decision_id=1)
        out["first_registered_s"] = await until(lambda: registered(1), a.timeout, "the first worker")
        await until(lambda: truthy(lambda: instances(fe_url) == 1), 60, "the frontend sees it")
        traffic = SteadyTraffic(fe_url, DEFAULT_MODEL, clients=a.clients, tokens=(8, 32), pause_s=0.2)
        await until(lambda: truthy(lambda: traffic.ok >= 2), 300, "traffic under way")

        first = conn.serving("agg")[0]
        t_up = time.monotonic()
        await conn.set_replicas({"agg": 2}, decision_id=2)
        second = next(w for w in conn.serving("agg") if w is not first)
        out["second_registered_s"] = await until(lambda: registered(2), a.timeout, "the second worker")
        url2 = f"http://127.0.0.1:{second.system_port}/metrics"
        out["second_first_requests_s"] = await until(
            lambda: truthy(lambda: metric(get(url2), "turbine_worker_requests_total") >= 2), 300,
            "the new worker serving") + out["second_registered_s"]
        await asyncio.sleep(a.both_s)
        out["requests_before_scale_down"] = traffic.ok
        t_down = time.monotonic()
        await conn.set_replicas({"agg": 1}, decision_id=3)  # returns once the stopped worker has exited
        out["scale_down_s"] = time.monotonic() - t_down
        stopped = next(w for w in (first, second) if w.stop_requested_at is not None)
        out.update(stopped=stopped.name, stopped_exit_code=stopped.returncode, loads_at_pick=conn.last_loads,
                   stopped_was_least_loaded=conn.last_loads[stopped.name] == min(conn.last_loads.values()))
        await asyncio.sleep(a.after_s)
        traffic.stop()
        fe_metrics = get(f"{fe_url}/metrics")
        out.update(requests_ok=traffic.ok, requests_failed=len(traffic.failures), failures=traffic.failures[:10],
                   requests_after_scale_down=traffic.completed_since(t_down),
                   migrations=metric(fe_metrics, "turbine_frontend_migrations_total"),
                   scale_up_to_down_s=t_down - t_up)
    finally:
        if traffic is not None:
            traffic.stop()
        await conn.close()
        frontend.terminate()
        frontend.wait(30)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--drain-timeout", type=float, default=20.0)
    p.add_argument("--both-s", type=float, default=20.0, help="seconds with both workers before scaling down")
    p.add_argument("--after-s", type=float, default=20.0, help="seconds of traffic after the scale-down")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a worker may take to register")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = asyncio.run(run(a))
    res["args"] = vars(a)
    res["host"] = "this 2-core CPU host (shared with other sessions' jobs)"
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}, indent=1))
    return 0 if res["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""A deployment on the NATS request plane, as real processes (simulated workers, frontends) on a private
nats-server with a small max_payload, with a cluster key: it serves the official openai client (streamed
and not); a worker with another key is skipped (it refuses the frontend's signed messages, unread); a
frontend on the other plane routes to none of its workers and says why; a request larger than the NATS
server takes is a 413 naming max_payload; an unreachable NATS server stops a worker naming the flag.
(The cases both planes share run on both: test_request_plane.py, test_migration_mocker.py,
test_kv_routing_nats.py, test_router_service.py.)"""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    free_port,
    http_json,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from tests.nats_server import NatsServer
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
KEY = "cluster-key-for-the-nats-request-plane"
OTHER_KEY = "another-cluster-key-nobody-else-has"
MOCKER = ("--speedup-ratio", "0", "--block-size", "16")
MAX_PAYLOAD = 16 << 10


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("nats-request-plane")
    nats = NatsServer(root / "nats.log", max_payload=MAX_PAYLOAD)
    nats.start()
    env = {**base_env(str(root / "discovery")), "TURBINE_CLUSTER_KEY": KEY, "TURBINE_NATS_SERVER": nats.url}
    on_nats = {**env, "TURBINE_REQUEST_PLANE": "nats"}
    workers = [start_mocker(f"nats-mocker-{i}", on_nats, root, *MOCKER) for i in (1, 2)]
    rogue = start_mocker("nats-other-key", on_nats, root, "--cluster-key", OTHER_KEY, *MOCKER)
    tcp_worker = start_mocker("tcp-mocker", env, root, *MOCKER)
    frontend = start_frontend("nats-frontend", on_nats, root)
    tcp_frontend = start_frontend("tcp-frontend", env, root)
    procs = [*workers, rogue, tcp_worker, frontend, tcp_frontend]
    try:
        wait_until(lambda: all(worker_ready(w) for w in (*workers, rogue, tcp_worker)), 60, "mockers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 3, 30, "the nats frontend sees its 3 workers", procs)
        wait_until(lambda: instances_of(tcp_frontend, MODEL) == 1, 30, "the tcp frontend sees its worker", procs)
        yield {"workers": workers, "rogue": rogue, "tcp_worker": tcp_worker, "frontend": frontend,
               "tcp_frontend": tcp_frontend, "env": on_nats, "root": root, "nats": nats}
    finally:
        stop_all(procs)
        nats.stop()


def served_by(worker) -> float:
    return metric(http_text(f"{worker.url}/metrics"), "turbine_worker_requests_total")


def test_the_official_client_is_served_over_nats_and_a_worker_with_another_key_is_skipped(deployment):
    client = OpenAI(base_url=f"{deployment['frontend'].url}/v1", api_key="x", max_retries=0, timeout=30)
    before = [served_by(w) for w in deployment["workers"]]
    for i in range(6):  # round robin over the three: the other-key worker's turns go elsewhere
        r = client.chat.completions.create(model=MODEL, max_tokens=4,
                                           messages=[{"role": "user", "content": f"Question {i}?"}])
        assert r.choices[0].message.content and r.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=5, stream=True))
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    assert sum(served_by(w) for w in deployment["workers"]) - sum(before) == 7  # every one, on keyed workers
    assert served_by(deployment["rogue"]) == 0
    assert "wrong or missing cluster-key signature" in deployment["rogue"].log_path.read_text()
    log = deployment["frontend"].log_path.read_text()
    assert "ConnectFailed" in log and "refused this process's messages" in log and "trying another" in log
    # The workers' addresses are NATS subjects, announced in discovery.
    cards = b"".join(p.read_bytes() for p in (deployment["root"] / "discovery").rglob("*") if p.is_file())
    assert f"{deployment['nats'].url}/turbine.rpc.".encode() in cards


def test_a_frontend_on_the_other_plane_routes_to_none_of_its_workers_and_says_why(deployment):
    tcp = deployment["tcp_frontend"]
    client = OpenAI(base_url=f"{tcp.url}/v1", api_key="x", max_retries=0, timeout=30)
    before = served_by(deployment["tcp_worker"])
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=2)
    assert served_by(deployment["tcp_worker"]) - before == 3
    assert "serves on the nats request plane, this frontend on tcp (--request-plane): not routed to" in \
        tcp.log_path.read_text()
    assert "serves on the tcp request plane, this frontend on nats" in deployment["frontend"].log_path.read_text()


def test_a_request_larger_than_the_nats_server_takes_is_a_413_naming_max_payload(deployment):
    prompt = list(range(1000, 1000 + 8000))  # 8000 token ids: about 24 KB on the wire, over 16 KiB
    r = httpx.post(f"{deployment['frontend'].url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert "max_payload" in error["message"] and str(MAX_PAYLOAD) in error["message"]
    assert error["type"] == "invalid_request_error"
    status, health = http_json(f"{deployment['frontend'].url}/health")  # nothing else hurt
    assert status == 200 and health["models"][MODEL] == 3


def test_an_unreachable_nats_server_stops_a_worker_naming_the_flag(deployment):
    url = f"nats://127.0.0.1:{free_port()}"
    proc = start_mocker("no-nats", deployment["env"], deployment["root"], "--nats-server", url, *MOCKER)
    try:
        assert proc.popen.wait(60) == 2
        assert f"--nats-server (request plane): cannot reach the NATS server {url}" in proc.log_path.read_text()
    finally:
        proc.stop()

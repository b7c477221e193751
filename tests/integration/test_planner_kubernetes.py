"""The planner's kubernetes connector with the official `kubernetes` client, against a small real
HTTP server standing in for the Kubernetes API server (none can run on these machines). The server
implements only what the connector uses: GET a Deployment, GET/PATCH its `scale` subresource, list
pods by label selector, PATCH a pod; it records every request, and the test checks the exact
method, path, query, content type and body the real client sends. On a scale-down it plays the
ReplicaSet controller's part as Kubernetes documents it: the pods with the lowest
`controller.kubernetes.io/pod-deletion-cost` go first (marked terminating, then removed by the test
as a kubelet would after the worker's drain). The workers' load comes from real HTTP /metrics
servers on the pods' (loopback) IPs."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from turbine.config import ConfigError
from turbine.planner.connector import make_connector
from turbine.planner.connectors.kubernetes import (
    ASLEEP,
    DELETION_COST,
    KEEP_COST,
    KubernetesConnector,
    KubernetesConnectorConfig,
)

NS = "llm"
SELECTOR = {"app.kubernetes.io/name": "turbine-decode", "turbine.dev/role": "decode"}


class FakeApiServer:
    def __init__(self):
        self.requests: list[dict] = []
        self.deployments = {"turbine-decode": {"replicas": 3, "ready": 3, "labels": SELECTOR}}
        self.pods: dict[str, dict] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

            def _handle(self, method):
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                url = urlparse(self.path)
                with outer.lock:
                    outer.requests.append({"method": method, "path": url.path, "query": parse_qs(url.query),
                                           "content_type": self.headers.get("content-type"), "body": body,
                                           "auth": self.headers.get("authorization")})
                    status, reply = outer.answer(method, url.path, parse_qs(url.query), body)
                self._reply(status, reply)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, method, path, query, body):
        parts = path.strip("/").split("/")
        if parts[:4] == ["apis", "apps", "v1", "namespaces"] and parts[4] == NS and parts[5] == "deployments":
            name = parts[6]
            dep = self.deployments.get(name)
            if dep is None:
                return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                             "code": 404, "message": f'deployments.apps "{name}" not found'}
            if len(parts) == 8 and parts[7] == "scale":
                if method == "PATCH":
                    self.scale_to(name, body["spec"]["replicas"])
                return 200, self.scale_json(name)
            return 200, {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NS},
                         "spec": {"replicas": dep["replicas"], "selector": {"matchLabels": dep["labels"]},
                                  "template": {"metadata": {"labels": dep["labels"]}}},
                         "status": {"replicas": dep["replicas"], "readyReplicas": dep["ready"]}}
        if parts[:4] == ["api", "v1", "namespaces", NS] and parts[4] == "pods":
            if len(parts) == 5:
                want = dict(kv.split("=") for kv in query["labelSelector"][0].split(","))
                items = [self.pod_json(n) for n, p in sorted(self.pods.items())
                         if all(p["labels"].get(k) == v for k, v in want.items())]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
            pod = self.pods[parts[5]]
            for key, value in body["metadata"]["annotations"].items():  # a strategic merge: null removes
                if value is None:
                    pod["annotations"].pop(key, None)
                else:
                    pod["annotations"][key] = value
            return 200, self.pod_json(parts[5])
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "message": path}

    def scale_json(self, name):
        dep = self.deployments[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": dep["replicas"]},
                "status": {"replicas": dep["replicas"],
                           "selector": ",".join(f"{k}={v}" for k, v in dep["labels"].items())}}

    def scale_to(self, name, n):
        """The ReplicaSet controller's part: surplus pods go lowest deletion cost first."""
        dep = self.deployments[name]
        dep["replicas"] = n
        live = [p for p in self.pods if not self.pods[p]["deleting"]]
        live.sort(key=lambda p: int(self.pods[p]["annotations"].get(DELETION_COST, "0")))
        for p in live[:max(0, len(live) - n)]:
            self.pods[p]["deleting"] = True
            dep["ready"] -= 1

    def pod_json(self, name):
        p = self.pods[name]
        meta = {"name": name, "namespace": NS, "labels": p["labels"], "annotations": p["annotations"]}
        if p["deleting"]:
            meta["deletionTimestamp"] = "2026-11-27T03:30:00Z"
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"podIP": p["ip"], "phase": "Running"}}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


class MetricsServer:
    """A pod's status port: /metrics with its requests in flight; POST /engine/sleep and /engine/wake_up
    recorded in `controls` (path, body) and answered as the worker does."""

    def __init__(self, ip: str, port: int, inflight: int):
        body = (f'turbine_worker_inflight_requests{{worker_id="w"}} {inflight}.0\n').encode()
        self.controls: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                outer.controls.append((self.path, json.loads(self.rfile.read(length)) if length else {}))
                reply = b'{"status": "success"}'
                self.send_response(200)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.http = ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def api(tmp_path):
    server = FakeApiServer()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
        "users": [{"name": "planner", "user": {"token": "planner-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "planner", "namespace": NS}}]}))
    try:
        yield server, str(kubeconfig)
    finally:
        server.close()


def free_port_on(ips) -> int:
    import socket
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


async def test_scale_up_then_down_patches_the_scale_and_removes_the_least_loaded_pod(api):
    server, kubeconfig = api
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = free_port_on(ips)
    loads = {"decode-a": 5, "decode-b": 1, "decode-c": 3}
    metrics = [MetricsServer(ip, port, loads[name]) for ip, name in zip(ips, loads, strict=True)]
    for ip, name in zip(ips, loads, strict=True):
        server.pods[name] = {"labels": dict(SELECTOR), "ip": ip, "annotations": {}, "deleting": False}

    class PlannerConfig:
        connector_options = {"deployments": {"decode": "turbine-decode"}, "namespace": NS,
                             "kubeconfig": kubeconfig, "status_port": port, "poll_s": 0.1, "drain_wait": 20}

    conn = make_connector("kubernetes", PlannerConfig())
    assert isinstance(conn, KubernetesConnector)
    await conn.start()
    try:
        assert await conn.current_replicas() == {"decode": 3}
        server.requests.clear()

        await conn.set_replicas({"decode": 4}, decision_id=1)  # up: one scale patch, nothing else
        assert [(r["method"], r["path"]) for r in server.requests] == [
            ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/turbine-decode/scale"),
            ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/turbine-decode/scale")]
        patch = server.requests[1]
        assert patch["body"] == {"spec": {"replicas": 4}}
        assert patch["content_type"] == "application/strategic-merge-patch+json"  # the client's choice for a dict
        assert {r["auth"] for r in server.requests} == {"Bearer planner-token"}  # the kubeconfig's user
        assert server.deployments["turbine-decode"]["replicas"] == 4
        # Asked for, not ready: the fourth pod is starting.
        assert await conn.current_replicas() == {"decode": 3}
        assert await conn.starting_replicas() == {"decode": 1}
        server.deployments["turbine-decode"]["replicas"] = 3  # (the fourth pod never came: back to 3)

        server.requests.clear()
        down = asyncio.create_task(conn.set_replicas({"decode": 2}, decision_id=2))
        await asyncio.sleep(1.0)
        # The least-loaded pod is the one terminating; set_replicas waits while it drains.
        assert [n for n, p in server.pods.items() if p["deleting"]] == ["decode-b"]
        assert conn.last_costs == {"decode-a": 5, "decode-b": 1, "decode-c": 3}
        assert not down.done()
        del server.pods["decode-b"]  # the kubelet: the worker drained and exited
        await asyncio.wait_for(down, 5)

        paths = [(r["method"], r["path"], r["query"]) for r in server.requests]
        assert paths[:4] == [
            ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/turbine-decode/scale", {}),
            ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/turbine-decode", {}),
            ("GET", f"/api/v1/namespaces/{NS}/pods",
             {"labelSelector": ["app.kubernetes.io/name=turbine-decode,turbine.dev/role=decode"]}),
            ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-a", {})]
        annotations = [r for r in server.requests if r["method"] == "PATCH" and "/pods/" in r["path"]]
        assert [(r["path"].rsplit("/", 1)[1], r["body"], r["content_type"]) for r in annotations] == [
            (name, {"metadata": {"annotations": {DELETION_COST: str(cost)}}}, "application/strategic-merge-patch+json")
            for name, cost in loads.items()]
        scale_patch = next(r for r in server.requests if r["method"] == "PATCH" and r["path"].endswith("/scale"))
        assert server.requests.index(scale_patch) > server.requests.index(annotations[-1])  # costs first
        assert scale_patch["body"] == {"spec": {"replicas": 2}}
        assert await conn.current_replicas() == {"decode": 2}
        assert await conn.starting_replicas() == {"decode": 0}
    finally:
        await conn.close()
        for m in metrics:
            m.close()


async def test_a_sleeping_pool_sleeps_the_least_loaded_pod_keeps_it_and_wakes_it_before_scaling_up(api):
    """sleep_pool 1, three pods: 3 -> 1 puts the least-loaded pod to sleep (its status port's /engine/sleep,
    then annotated asleep with the highest deletion cost) and removes one more through the scale, which the
    ReplicaSet takes from the awake pods; 1 -> 2 wakes the sleeper (annotation removed) with no scale patch;
    2 -> 3 raises the replicas by one."""
    server, kubeconfig = api
    ips = ["127.0.0.5", "127.0.0.6", "127.0.0.7"]
    port = free_port_on(ips)
    loads = {"decode-a": 5, "decode-b": 1, "decode-c": 3}
    pods = {name: MetricsServer(ip, port, loads[name]) for ip, name in zip(ips, loads, strict=True)}
    for ip, name in zip(ips, loads, strict=True):
        server.pods[name] = {"labels": dict(SELECTOR), "ip": ip, "annotations": {}, "deleting": False}
    conn = KubernetesConnector(KubernetesConnectorConfig.from_dict(
        {"deployments": {"decode": "turbine-decode"}, "namespace": NS, "kubeconfig": kubeconfig,
         "status_port": str(port), "poll_s": 0.1, "drain_wait": 20, "sleep_pool": "1"}))
    await conn.start()
    try:
        assert conn.pool_capacity() == {"decode": 1} and await conn.sleeping_replicas() == {"decode": 0}
        down = asyncio.create_task(conn.set_replicas({"decode": 1}, decision_id=1))
        await asyncio.sleep(1.0)
        assert pods["decode-b"].controls == [("/engine/sleep", {"level": 1})]
        assert server.pods["decode-b"]["annotations"] == {ASLEEP: "true", DELETION_COST: str(KEEP_COST)}
        assert server.deployments["turbine-decode"]["replicas"] == 2  # the sleeper stays in the count
        assert [n for n, p in server.pods.items() if p["deleting"]] == ["decode-c"]  # awake, least loaded
        del server.pods["decode-c"]  # the kubelet: drained and exited
        await asyncio.wait_for(down, 5)
        server.deployments["turbine-decode"]["ready"] = 1  # the sleeper's /health says sleeping: not ready
        assert await conn.sleeping_replicas() == {"decode": 1}
        assert await conn.current_replicas() == {"decode": 1}
        assert await conn.starting_replicas() == {"decode": 0}  # asleep is not starting

        server.requests.clear()
        await conn.set_replicas({"decode": 2}, decision_id=2)  # a wake, no scale patch
        assert pods["decode-b"].controls[-1] == ("/engine/wake_up", {})
        assert ASLEEP not in server.pods["decode-b"]["annotations"]
        assert not [r for r in server.requests if r["method"] == "PATCH" and r["path"].endswith("/scale")]
        assert server.deployments["turbine-decode"]["replicas"] == 2
        assert await conn.sleeping_replicas() == {"decode": 0}

        await conn.set_replicas({"decode": 3}, decision_id=3)  # nobody asleep: the scale
        assert server.deployments["turbine-decode"]["replicas"] == 3
    finally:
        await conn.close()
        for m in pods.values():
            m.close()
    with pytest.raises(ConfigError, match="status_port"):
        KubernetesConnectorConfig({"decode": "d"}, namespace=NS, status_port=None, sleep_pool=1)


async def test_a_wrong_deployment_name_fails_at_start_and_unknown_roles_are_refused(api):
    server, kubeconfig = api
    conn = KubernetesConnector(KubernetesConnectorConfig({"decode": "nope"}, namespace=NS, kubeconfig=kubeconfig))
    with pytest.raises(Exception, match="Not Found|404"):
        await conn.start()
    await conn.close()
    conn = KubernetesConnector(KubernetesConnectorConfig({"decode": "turbine-decode"}, namespace=NS,
                                                         kubeconfig=kubeconfig))
    await conn.start()
    try:
        with pytest.raises(ValueError, match="no Deployment configured for role.*prefill"):
            await conn.set_replicas({"prefill": 1}, decision_id=1)
    finally:
        await conn.close()
    with pytest.raises(ConfigError, match="unknown kubernetes connector option"):
        KubernetesConnectorConfig.from_dict({"deployments": {"decode": "x"}, "replicas": 2})
    with pytest.raises(ConfigError, match="unknown role"):
        KubernetesConnectorConfig({"encode": "x"})

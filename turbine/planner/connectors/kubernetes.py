"""The kubernetes connector: one Deployment per role (frontend and planner run beside them); the
planner sets each role's replica count through the Deployment's `scale` subresource with the
official `kubernetes` client (in-cluster credentials, or a kubeconfig).

Scale-down never fails a request: before lowering a count, the connector asks each of the role's
pods for its load (generate requests in flight on its status port's /metrics) and writes it as the
pod's `controller.kubernetes.io/pod-deletion-cost` annotation, so the ReplicaSet deletes the
least-loaded pods first. A deleted pod gets SIGTERM: the worker unregisters, serves what it holds
for its `--graceful-shutdown-timeout` and ends what still runs with `shutting_down`, which the
frontend migrates (the pod's terminationGracePeriodSeconds must exceed that timeout; the shipped
manifests do). set_replicas returns once the role has no more pods than asked for, terminating ones
included, i.e. once the removed workers have drained and exited.

Ready workers per role come from the Deployment's status (`readyReplicas`: pods whose readiness
probe, the worker's /health, passes). RBAC: get on deployments, get/patch on deployments/scale,
list on pods, patch on pods (deploy/kubernetes/planner/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import httpx

from turbine.config import ConfigError, check
from turbine.planner.connector import ROLES, register_connector

log = logging.getLogger("turbine.planner.kubernetes")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
INFLIGHT_METRIC = "turbine_worker_inflight_requests"


@dataclass(frozen=True)
class KubernetesConnectorConfig:
    deployments: dict[str, str] = field(default_factory=dict)  # role -> name of the Deployment running it
    namespace: str = field(default_factory=lambda: _own_namespace() or "default")
    kubeconfig: str | None = None  # None: in-cluster credentials (the planner's ServiceAccount)
    status_port: int | None = 9090  # the workers' --system-port (their /metrics); None: no load-aware pick
    drain_wait: float = 120.0  # seconds set_replicas waits for removed pods to be gone
    poll_s: float = 1.0

    def __post_init__(self):
        check(self, bool(self.deployments), "deployments", "name the Deployment of at least one role")
        bad = sorted(set(self.deployments) - set(ROLES))
        check(self, not bad, "deployments", f"unknown role(s) {', '.join(bad)}; choose from {', '.join(ROLES)}")
        check(self, bool(self.namespace), "namespace", "must be non-empty")
        check(self, self.status_port is None or 0 < self.status_port < 65536, "status_port", "must be a port")
        check(self, self.drain_wait > 0 and self.poll_s > 0, "drain_wait", "drain_wait and poll_s must be > 0")

    @classmethod
    def from_dict(cls, options: dict) -> KubernetesConnectorConfig:
        known = {"deployments", "namespace", "kubeconfig", "status_port", "drain_wait", "poll_s"}
        if bad := sorted(set(options) - known):
            raise ConfigError(cls, "deployments", f"unknown kubernetes connector option(s) {', '.join(bad)}; "
                                                  f"known: {', '.join(sorted(known))}")
        values = dict(options)  # --connector-option KEY=VALUE gives strings
        for key, kind in (("status_port", int), ("drain_wait", float), ("poll_s", float)):
            if isinstance(values.get(key), str):
                values[key] = kind(values[key])
        return cls(**values)


def _own_namespace() -> str | None:
    """The planner pod's namespace (its ServiceAccount's mount), None outside a cluster."""
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class KubernetesConnector:
    def __init__(self, cfg: KubernetesConnectorConfig):
        self.cfg = cfg
        self.apps = self.core = None
        self._http: httpx.AsyncClient | None = None
        self.last_costs: dict[str, int] = {}  # pod -> deletion cost written at the last scale-down

    async def start(self) -> None:
        from kubernetes import client, config  # only when this connector is chosen

        if self.cfg.kubeconfig is not None:
            api = config.new_client_from_config(config_file=self.cfg.kubeconfig)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            api = client.ApiClient()
        else:
            raise ConfigError(self.cfg, "kubeconfig",
                              "not in a cluster (no KUBERNETES_SERVICE_HOST): give a kubeconfig")
        self.apps, self.core = client.AppsV1Api(api), client.CoreV1Api(api)
        self._http = httpx.AsyncClient(timeout=2.0)
        for role, name in self.cfg.deployments.items():  # fail at start on a wrong name or missing rights
            await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, self.cfg.namespace)
            log.info("role %s: Deployment %s/%s", role, self.cfg.namespace, name)

    async def current_replicas(self) -> dict[str, int]:
        out = {}
        for role, name in self.cfg.deployments.items():
            dep = await asyncio.to_thread(self.apps.read_namespaced_deployment, name, self.cfg.namespace)
            out[role] = (dep.status.ready_replicas or 0) if dep.status else 0
        return out

    async def starting_replicas(self) -> dict[str, int]:
        """Per role, the Deployment's asked-for replicas that are not ready yet."""
        out = {}
        for role, name in self.cfg.deployments.items():
            dep = await asyncio.to_thread(self.apps.read_namespaced_deployment, name, self.cfg.namespace)
            ready = (dep.status.ready_replicas or 0) if dep.status else 0
            out[role] = max(0, (dep.spec.replicas or 0) - ready)
        return out

    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None:
        if bad := sorted(set(targets) - set(self.cfg.deployments)):
            raise ValueError(f"no Deployment configured for role(s) {', '.join(bad)}")
        if bad := {r: t for r, t in targets.items() if t < 0}:
            raise ValueError(f"decision {decision_id}: negative target(s) {bad}")
        shrinking = []
        for role, target in targets.items():
            name, ns = self.cfg.deployments[role], self.cfg.namespace
            scale = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, ns)
            have = scale.spec.replicas or 0
            if target == have:
                continue
            if target < have:
                await self._mark_least_loaded(role)
                shrinking.append(role)
            await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, ns,
                                    {"spec": {"replicas": target}})
            log.info("decision %d: %s (Deployment %s) %d -> %d", decision_id, role, name, have, target)
        if shrinking:
            await self._wait_drained({r: targets[r] for r in shrinking}, decision_id)

    async def _pods(self, role: str) -> list:
        name, ns = self.cfg.deployments[role], self.cfg.namespace
        dep = await asyncio.to_thread(self.apps.read_namespaced_deployment, name, ns)
        labels = dep.spec.selector.match_labels or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return (await asyncio.to_thread(self.core.list_namespaced_pod, ns, label_selector=selector)).items

    async def _load(self, pod) -> float:
        ip = pod.status.pod_ip if pod.status else None
        if not ip or self._http is None:
            return float("inf")
        try:
            r = await self._http.get(f"http://{ip}:{self.cfg.status_port}/metrics")
            r.raise_for_status()
        except httpx.HTTPError:
            return float("inf")
        return _metric_sum(r.text, INFLIGHT_METRIC)

    async def _mark_least_loaded(self, role: str) -> None:
        """Each live pod's deletion cost = its requests in flight (one that does not answer: the
        highest), so the ReplicaSet removes the least-loaded first."""
        if self.cfg.status_port is None:
            return
        pods = [p for p in await self._pods(role) if p.metadata.deletion_timestamp is None]
        loads = await asyncio.gather(*(self._load(p) for p in pods))
        for pod, load in zip(pods, loads, strict=True):
            cost = 2**31 - 1 if load == float("inf") else int(load)  # the annotation is an int32
            self.last_costs[pod.metadata.name] = cost
            await asyncio.to_thread(self.core.patch_namespaced_pod, pod.metadata.name, self.cfg.namespace,
                                    {"metadata": {"annotations": {DELETION_COST: str(cost)}}})

    async def _wait_drained(self, targets: dict[str, int], decision_id: int) -> None:
        deadline = time.monotonic() + self.cfg.drain_wait
        while True:
            counts = {role: len(await self._pods(role)) for role in targets}
            if all(counts[r] <= t for r, t in targets.items()):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"decision {decision_id}: pods still there after {self.cfg.drain_wait:g}s: "
                                   f"{counts} (wanted {targets})")
            await asyncio.sleep(self.cfg.poll_s)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        for api in (self.apps, self.core):
            if api is not None:
                api.api_client.close()


def _from_planner_config(config: object) -> KubernetesConnector:
    if isinstance(config, KubernetesConnectorConfig):
        return KubernetesConnector(config)
    return KubernetesConnector(KubernetesConnectorConfig.from_dict(getattr(config, "connector_options", None) or {}))


register_connector("kubernetes", _from_planner_config)

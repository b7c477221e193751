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

Sleeping pool (`sleep_pool` N > 0, needs `status_port`): the Deployment's replicas are the awake
pods plus the asleep ones. A step down first puts up to N pods of the role to sleep, the least
loaded first: `POST /engine/sleep` on the pod's status port (it leaves discovery, drains, frees its
engine's memory; its /health then says `sleeping`, 503, so it leaves `readyReplicas`), then the pod
is annotated `turbine.dev/asleep: "true"` with the highest deletion cost, so that the ReplicaSet
never picks it while awake pods go. Only the pods beyond the pool are removed, as above. A step up
first wakes annotated pods (`POST /engine/wake_up`, the annotation removed) and raises the
replicas only for the rest.
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
ASLEEP = "turbine.dev/asleep"  # a pod of the sleeping pool
KEEP_COST = 2**31 - 1  # the highest deletion cost (an int32): the ReplicaSet removes such a pod last
INFLIGHT_METRIC = "turbine_worker_inflight_requests"


@dataclass(frozen=True)
class KubernetesConnectorConfig:
    deployments: dict[str, str] = field(default_factory=dict)  # role -> name of the Deployment running it
    namespace: str = field(default_factory=lambda: _own_namespace() or "default")
    kubeconfig: str | None = None  # None: in-cluster credentials (the planner's ServiceAccount)
    status_port: int | None = 9090  # the workers' --system-port (their /metrics); None: no load-aware pick
    drain_wait: float = 120.0  # seconds set_replicas waits for removed pods to be gone
    poll_s: float = 1.0
    sleep_pool: int = 0  # pods per role a step down puts to sleep (up to this many asleep) before removing any
    sleep_level: int = 1

    def __post_init__(self):
        check(self, bool(self.deployments), "deployments", "name the Deployment of at least one role")
        bad = sorted(set(self.deployments) - set(ROLES))
        check(self, not bad, "deployments", f"unknown role(s) {', '.join(bad)}; choose from {', '.join(ROLES)}")
        check(self, bool(self.namespace), "namespace", "must be non-empty")
        check(self, self.status_port is None or 0 < self.status_port < 65536, "status_port", "must be a port")
        check(self, self.drain_wait > 0 and self.poll_s > 0, "drain_wait", "drain_wait and poll_s must be > 0")
        check(self, isinstance(self.sleep_pool, int) and self.sleep_pool >= 0, "sleep_pool", "must be an integer >= 0")
        check(self, self.sleep_pool == 0 or self.status_port is not None, "sleep_pool",
              "needs status_port: pods are put to sleep and woken on their status port")
        check(self, self.sleep_level in (1, 2), "sleep_level", "choose 1 (KV cache freed) or 2 (weights too)")

    @classmethod
    def from_dict(cls, options: dict) -> KubernetesConnectorConfig:
        known = {"deployments", "namespace", "kubeconfig", "status_port", "drain_wait", "poll_s", "sleep_pool",
                 "sleep_level"}
        if bad := sorted(set(options) - known):
            raise ConfigError(cls, "deployments", f"unknown kubernetes connector option(s) {', '.join(bad)}; "
                                                  f"known: {', '.join(sorted(known))}")
        values = dict(options)  # --connector-option KEY=VALUE gives strings
        for key, kind in (("status_port", int), ("drain_wait", float), ("poll_s", float), ("sleep_pool", int),
                          ("sleep_level", int)):
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
        """Per role, the Deployment's asked-for replicas that are not ready yet (nor asleep)."""
        out = {}
        for role, name in self.cfg.deployments.items():
            dep = await asyncio.to_thread(self.apps.read_namespaced_deployment, name, self.cfg.namespace)
            ready = (dep.status.ready_replicas or 0) if dep.status else 0
            asleep = len(await self._asleep(role)) if self.cfg.sleep_pool else 0
            out[role] = max(0, (dep.spec.replicas or 0) - ready - asleep)
        return out

    async def sleeping_replicas(self) -> dict[str, int]:
        """Pods of the sleeping pool per role (annotated asleep, not terminating)."""
        return {role: len(await self._asleep(role)) if self.cfg.sleep_pool else 0 for role in self.cfg.deployments}

    def pool_capacity(self) -> dict[str, int]:
        return dict.fromkeys(self.cfg.deployments, self.cfg.sleep_pool)

    async def _asleep(self, role: str) -> list:
        return [p for p in await self._pods(role) if p.metadata.deletion_timestamp is None
                and ((p.metadata.annotations or {}).get(ASLEEP) == "true")]

    async def set_replicas(self, targets: dict[str, int], decision_id: int) -> None:
        if bad := sorted(set(targets) - set(self.cfg.deployments)):
            raise ValueError(f"no Deployment configured for role(s) {', '.join(bad)}")
        if bad := {r: t for r, t in targets.items() if t < 0}:
            raise ValueError(f"decision {decision_id}: negative target(s) {bad}")
        shrinking = {}
        for role, target in targets.items():
            name, ns = self.cfg.deployments[role], self.cfg.namespace
            scale = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, ns)
            have = scale.spec.replicas or 0
            asleep = await self._asleep(role) if self.cfg.sleep_pool else []
            awake = have - len(asleep)  # the pool's pods are in the Deployment's count
            if target == awake:
                continue
            if target > awake:
                woken = await self._wake(asleep[:target - awake])
                replicas = have + (target - awake - woken)
            else:
                slept = await self._sleep_least_loaded(role, min(awake - target, self.cfg.sleep_pool - len(asleep)))
                replicas = have - (awake - target - slept)
                if replicas < have:
                    await self._mark_least_loaded(role)
                    shrinking[role] = replicas
            if replicas != have:
                await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, ns,
                                        {"spec": {"replicas": replicas}})
            log.info("decision %d: %s (Deployment %s) %d -> %d awake; replicas %d -> %d", decision_id, role, name,
                     awake, target, have, replicas)
        if shrinking:
            await self._wait_drained(shrinking, decision_id)

    async def _control(self, pod, action: str, body: dict) -> None:
        """POST /engine/<action> on the pod's status port; raises unless it succeeded."""
        from turbine.runtime import cluster_auth

        assert self._http is not None, "start() first"
        key = cluster_auth.current().key
        headers = {"Authorization": f"Bearer {key.decode()}"} if key else {}
        r = await self._http.post(f"http://{pod.status.pod_ip}:{self.cfg.status_port}/engine/{action}", json=body,
                                  headers=headers, timeout=self.cfg.drain_wait)
        if r.status_code != 200:
            raise RuntimeError(f"{action} answered {r.status_code}: {r.text[:200]}")

    async def _annotate(self, pod, annotations: dict) -> None:
        await asyncio.to_thread(self.core.patch_namespaced_pod, pod.metadata.name, self.cfg.namespace,
                                {"metadata": {"annotations": annotations}})

    async def _sleep_least_loaded(self, role: str, count: int) -> int:
        """Put up to `count` of the role's least-loaded awake pods to sleep; returns how many slept."""
        if count <= 0:
            return 0
        pods = [p for p in await self._pods(role) if p.metadata.deletion_timestamp is None
                and (p.metadata.annotations or {}).get(ASLEEP) != "true" and p.status and p.status.pod_ip]
        loads = await asyncio.gather(*(self._load(p) for p in pods))
        chosen = [p for _, p in sorted(zip(loads, pods, strict=True), key=lambda lp: lp[0])[:count]]

        async def sleep(pod) -> bool:
            try:
                await self._control(pod, "sleep", {"level": self.cfg.sleep_level})
            except (httpx.HTTPError, RuntimeError) as exc:
                log.warning("pod %s could not sleep (%s): removed instead", pod.metadata.name, exc)
                return False
            await self._annotate(pod, {ASLEEP: "true", DELETION_COST: str(KEEP_COST)})
            log.info("pod %s asleep: in the pool", pod.metadata.name)
            return True

        return sum(await asyncio.gather(*(sleep(p) for p in chosen)))

    async def _wake(self, pods: list) -> int:
        """Wake these pods of the pool; returns how many serve again (the annotation removed)."""
        async def wake(pod) -> bool:
            try:
                await self._control(pod, "wake_up", {})
            except (httpx.HTTPError, RuntimeError) as exc:
                log.warning("pod %s did not wake (%s): another pod is asked for instead", pod.metadata.name, exc)
                return False
            await self._annotate(pod, {ASLEEP: None})  # null: removed (a strategic merge patch)
            log.info("pod %s woken", pod.metadata.name)
            return True

        return sum(await asyncio.gather(*(wake(p) for p in pods)))

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
        pods = [p for p in await self._pods(role) if p.metadata.deletion_timestamp is None
                and (p.metadata.annotations or {}).get(ASLEEP) != "true"]  # the pool's keep KEEP_COST
        loads = await asyncio.gather(*(self._load(p) for p in pods))
        for pod, load in zip(pods, loads, strict=True):
            cost = KEEP_COST if load == float("inf") else int(load)  # the annotation is an int32
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

"""The Kubernetes manifests under deploy/: every document valid against the Kubernetes schemas
(kubernetes-validate, strict, offline), and each of the three deployments wired the way Turbine
works: args that Turbine's parsers accept, probes on the ports those args open, grace periods
that cover the worker's drain, discovery through the etcd Service, the frontend's Service."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.manifests import (
    K8S_DEPLOYMENTS,
    KUBERNETES,
    by_kind,
    container_env,
    deployment_set,
    is_k8s,
    k8s_documents,
    load_documents,
    parse_turbine,
    validate_k8s,
    yaml_files,
)
from turbine.frontend.server import GRACEFUL_SHUTDOWN_S

# Seconds a worker's pod needs beyond --graceful-shutdown-timeout: unregistering before the drain,
# and closing the engine after it.
ENGINE_CLOSE_MARGIN_S = 15

DOCS = k8s_documents()


def test_the_manifests_are_found():
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds
    for name in ("common", *K8S_DEPLOYMENTS):
        assert yaml_files(KUBERNETES / name), name


@pytest.mark.parametrize("path", yaml_files(KUBERNETES), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_every_document_under_deploy_kubernetes_is_a_kubernetes_object(path):
    docs = load_documents(path)
    assert docs, f"{path}: empty"
    assert all(is_k8s(d) for d in docs), f"{path}: a document without apiVersion and kind"


@pytest.mark.parametrize(("path", "doc"), DOCS, ids=[f"{p.relative_to(KUBERNETES.parent)}:{d['kind']}/"
                                                     f"{d['metadata']['name']}" for p, d in DOCS])
def test_valid_against_the_kubernetes_schemas(path, doc):
    validate_k8s(doc)


def _frontend_deployment() -> dict:
    return copy.deepcopy(by_kind(deployment_set("aggregated"), "Deployment")["turbine-frontend"])


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"].update(replica=2),  # a typo: strict validation refuses unknown fields
    lambda d: d["spec"].update(replicas="two"),  # a wrong type
    lambda d: d["spec"]["template"]["spec"].pop("containers"),  # a required field missing
    lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].pop("port"),
], ids=["unknown-field", "wrong-type", "missing-containers", "probe-without-port"])
def test_an_invalid_manifest_fails_validation(break_it):
    doc = _frontend_deployment()
    validate_k8s(doc)  # valid as shipped
    break_it(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(doc)


# -- each deployment, as Turbine needs it -----------------------------------------------------------

def _turbine_containers(docs):
    for dep in by_kind(docs, "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["image"].startswith("turbine:"):
                yield dep, pod, c, parse_turbine(c["args"], container_env(c, docs))


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _probe_port(container: dict, probe: str) -> int:
    port = container[probe]["httpGet"]["port"]
    return _port(container, port) if isinstance(port, str) else port


@pytest.fixture(scope="module", params=K8S_DEPLOYMENTS)
def deployment(request):
    docs = deployment_set(request.param)
    return request.param, docs, list(_turbine_containers(docs))


def test_selectors_match_their_pods(deployment):
    _, docs, _ = deployment
    for name, dep in by_kind(docs, "Deployment").items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, svc in by_kind(docs, "Service").items():
        matching = [d for d in by_kind(docs, "Deployment").values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {name} selects {len(matching)} Deployments"
        container_ports = {p["name"] for c in matching[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports, name


def test_every_container_has_resources_and_probes(deployment):
    _, docs, _ = deployment
    for dep in by_kind(docs, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]


def test_the_frontend_serves_on_every_interface_behind_its_service(deployment):
    name, docs, parsed = deployment
    frontends = [(dep, pod, c, p) for dep, pod, c, p in parsed if p.command == "frontend"]
    assert len(frontends) == 1
    dep, pod, c, p = frontends[0]
    cfg = p.config
    assert cfg.http_host == "0.0.0.0"  # in a pod, loopback would be unreachable for the Service
    assert _port(c, "http") == cfg.http_port
    # Ready when a model is servable (/health: 503 until a worker registered); alive = /live.
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and _probe_port(c, "readinessProbe") == cfg.http_port
    assert c["livenessProbe"]["httpGet"]["path"] == "/live" and _probe_port(c, "livenessProbe") == cfg.http_port
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + GRACEFUL_SHUTDOWN_S
    service = by_kind(docs, "Service")["turbine-frontend"]
    assert service["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert cfg.router.mode == ("kv" if name == "kv-routed" else "round-robin")
    assert cfg.migration.limit >= 1  # a worker pod deleted in a rollout: its unfinished requests move on


def test_workers_probe_their_status_port_and_outlive_their_drain(deployment):
    name, docs, parsed = deployment
    workers = [(dep, pod, c, p) for dep, pod, c, p in parsed if p.command == "worker"]
    roles = sorted(p.config.disaggregation_mode for *_, p in workers)
    assert roles == (["decode", "prefill"] if name == "disaggregated" else ["agg"])
    for dep, pod, c, p in workers:
        cfg = p.config
        # The kubelet probes the pod IP.
        assert cfg.system_host == "0.0.0.0" and _port(c, "status") == cfg.system_port
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"
        assert _probe_port(c, "readinessProbe") == _probe_port(c, "livenessProbe") == cfg.system_port
        assert pod["terminationGracePeriodSeconds"] >= cfg.graceful_shutdown_timeout + ENGINE_CLOSE_MARGIN_S
        assert cfg.host == "0.0.0.0" and cfg.security.has_key  # reachable by the frontend, and keyed
        assert cfg.event_plane == "nats"
        if name == "kv-routed":
            assert dep["spec"]["replicas"] >= 2  # something to choose between


def test_discovery_and_events_go_through_the_common_services(deployment):
    _, docs, parsed = deployment
    services = {f"{n}:{p['port']}" for n, s in by_kind(docs, "Service").items() for p in s["spec"]["ports"]}
    for *_, p in parsed:
        cfg = p.config
        assert cfg.discovery.backend == "etcd"
        assert set(cfg.discovery.etcd_endpoints) <= services, cfg.discovery.etcd_endpoints
        if p.command == "worker":
            assert cfg.nats_server.removeprefix("nats://") in services


def test_a_renamed_flag_in_the_args_fails_the_parse():
    docs = deployment_set("aggregated")
    worker = by_kind(docs, "Deployment")["turbine-worker"]["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("--graceful-shutdown-timeout", "--drain-timeout") for a in worker["args"]]
    with pytest.raises(SystemExit):
        parse_turbine(args, container_env(worker, docs))

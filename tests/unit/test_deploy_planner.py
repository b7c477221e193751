"""deploy/kubernetes/planner/: every document validates against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors), and the pieces agree with each other and
with the kubernetes connector: the planner's config names the worker Deployments of this folder, by
role, and its Role grants exactly the API calls the connector makes."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from turbine.planner.connectors.kubernetes import KubernetesConnectorConfig

FOLDER = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "planner"
DOCS = [(f.name, i, d) for f in sorted(FOLDER.glob("*.yaml"))
        for i, d in enumerate(yaml.safe_load_all(f.read_text())) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, _, d in DOCS if d["kind"] == kind}


@pytest.mark.parametrize(("name", "index", "doc"), DOCS, ids=[f"{n}#{i}" for n, i, _ in DOCS])
def test_each_document_validates_against_the_kubernetes_schema(name, index, doc):
    kubernetes_validate.validate(doc, "1.31", strict=True)


def test_the_planner_config_names_the_worker_deployments_and_the_role_grants_what_the_connector_does():
    assert len(DOCS) == 9
    deployments = by_kind("Deployment")
    config = yaml.safe_load(by_kind("ConfigMap")["turbine-planner"]["data"]["planner.yaml"])
    assert config["connector"] == "kubernetes"
    options = KubernetesConnectorConfig.from_dict({**config["connector_options"], "namespace": "any"})
    for role, name in options.deployments.items():
        dep = deployments[name]
        assert dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
        assert "replicas" not in dep["spec"]  # the planner owns the count; re-applying keeps it
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--disaggregation-mode") + 1] == role
        assert args[args.index("--system-port") + 1] == str(options.status_port)
        drain = float(args[args.index("--graceful-shutdown-timeout") + 1])
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert drain + 1 < grace < options.drain_wait  # the drain fits; the planner waits for it
    rules = {(g, r, tuple(sorted(rule.get("resourceNames", ["*"])))): set(rule["verbs"])
             for rule in by_kind("Role")["turbine-planner"]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    names = tuple(sorted(options.deployments.values()))
    assert rules == {("apps", "deployments", names): {"get"}, ("apps", "deployments/scale", names): {"get", "patch"},
                     ("", "pods", ("*",)): {"list", "patch"}}
    planner = deployments["turbine-planner"]["spec"]["template"]["spec"]
    assert planner["serviceAccountName"] == by_kind("ServiceAccount")["turbine-planner"]["metadata"]["name"]
    binding = by_kind("RoleBinding")["turbine-planner"]
    assert binding["roleRef"]["name"] == "turbine-planner" and binding["subjects"][0]["name"] == "turbine-planner"
    frontend = deployments["turbine-frontend"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert int(frontend[frontend.index("--migration-limit") + 1]) >= 1  # what outlives a drain migrates

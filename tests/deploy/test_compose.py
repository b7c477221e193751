"""deploy/compose/compose.yaml, checked by Docker Compose v2 itself (`config`: the Compose
Specification's schema, anchors, profiles, interpolation; no Docker engine needed), and each
profile's Turbine services wired as Turbine works: commands Turbine's parsers accept, health
checks on the ports those commands open, stop grace periods that cover the worker's drain."""

from __future__ import annotations

import re

import pytest

from tests.deploy.manifests import (
    COMPOSE_FILE,
    COMPOSE_PROFILES,
    compose_command,
    compose_config,
    parse_turbine,
    run_compose,
)
from turbine.frontend.server import GRACEFUL_SHUTDOWN_S

ENGINE_CLOSE_MARGIN_S = 15  # as for the Kubernetes pods (test_kubernetes.py)


def _seconds(duration: str) -> float:
    value = 0.0
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        value += float(amount) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return value


def test_compose_is_v2():
    result = run_compose(COMPOSE_FILE, "version", "--short")
    assert result.returncode == 0 and result.stdout.strip().lstrip("v").startswith("2."), (compose_command(), result)


def test_the_file_needs_a_cluster_key():
    result = run_compose(COMPOSE_FILE, "--profile", "agg", "config", "-q")
    assert result.returncode != 0 and "TURBINE_CLUSTER_KEY" in result.stderr


@pytest.mark.parametrize("break_it", [
    ("  etcd:\n", "  etcd:\n    restart_policy: always\n"),  # no such service field
    ("etcd: {condition: service_healthy}", "etc: {condition: service_healthy}"),  # a service that does not exist
    ("interval: 5s", "interval: five seconds"),  # not a duration
], ids=["unknown-field", "missing-dependency", "bad-duration"])
def test_an_invalid_compose_file_fails(tmp_path, break_it):
    old, new = break_it
    text = COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    ok = run_compose(COMPOSE_FILE, "--profile", "mocker", "config", "-q", env={"TURBINE_CLUSTER_KEY": "k" * 32})
    assert ok.returncode == 0, ok.stderr
    bad = run_compose(broken, "--profile", "mocker", "config", "-q", env={"TURBINE_CLUSTER_KEY": "k" * 32})
    assert bad.returncode != 0


@pytest.fixture(scope="module", params=COMPOSE_PROFILES)
def profile(request):
    """(profile, {service: (rendered service, parsed command)}) for the Turbine services of a profile."""
    services = compose_config(request.param)["services"]
    turbine = {name: (svc, parse_turbine(svc["command"], svc.get("environment") or {}))
               for name, svc in services.items() if svc["image"].startswith("turbine:")}
    return request.param, services, turbine


def _health_port(svc: dict) -> int:
    test = " ".join(svc["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)/health'", test)
    assert match, test
    return int(match.group(1))


def test_etcd_and_nats_come_first(profile):
    _, services, turbine = profile
    assert {"etcd", "nats"} <= services.keys()
    for name, (svc, parsed) in turbine.items():
        needs = {"etcd", "nats"} if parsed.command in ("worker", "mocker") else {"etcd"}
        assert needs <= svc["depends_on"].keys(), name
        assert all(svc["depends_on"][n]["condition"] == "service_healthy" for n in needs)
        assert "healthcheck" in services["etcd"] and "healthcheck" in services["nats"]


def test_the_frontend_is_published_and_healthy_when_a_model_is_servable(profile):
    name, _, turbine = profile
    frontends = [(svc, p) for svc, p in turbine.values() if p.command == "frontend"]
    assert len(frontends) == 1
    svc, p = frontends[0]
    cfg = p.config
    assert cfg.http_host == "0.0.0.0"  # the published port reaches the container's interface
    assert [port["target"] for port in svc["ports"]] == [cfg.http_port]
    assert _health_port(svc) == cfg.http_port
    assert _seconds(svc["stop_grace_period"]) >= GRACEFUL_SHUTDOWN_S
    assert cfg.router.mode == ("kv" if name in ("kv", "mocker") else "round-robin")
    assert cfg.migration.limit >= 1  # a stopped worker's unfinished requests move to another
    assert cfg.discovery.backend == "etcd" and cfg.discovery.etcd_endpoints == ("etcd:2379",)


def test_workers_are_healthy_when_serving_and_outlive_their_drain(profile):
    name, _, turbine = profile
    workers = [(svc, p) for svc, p in turbine.values() if p.command in ("worker", "mocker")]
    roles = sorted(p.config.disaggregation_mode for _, p in workers)
    assert roles == (["decode", "prefill"] if name == "disagg" else ["agg"])
    for svc, p in workers:
        cfg = p.config
        assert _health_port(svc) == cfg.system_port
        assert _seconds(svc["stop_grace_period"]) >= cfg.graceful_shutdown_timeout + ENGINE_CLOSE_MARGIN_S
        assert cfg.host == "0.0.0.0" and cfg.security.has_key
        assert cfg.discovery.backend == "etcd" and cfg.event_plane == "nats" and cfg.nats_server == "nats://nats:4222"
        if p.command == "worker":
            assert svc.get("shm_size"), "vLLM needs more than Docker's 64 MB /dev/shm"
        if name == "kv":
            assert svc["deploy"]["replicas"] >= 2

"""The Grafana dashboard cannot drift from the code: every metric its PromQL names is one that
Turbine registers (frontend, router, worker, mocker registries, by type: a counter is read as
`_total`, a histogram as `_bucket`/`_sum`/`_count`) or one of vLLM's (from the installed vLLM's
metric definitions), and every label it groups or filters by is one of those metrics' labels.
The Prometheus scrape config is checked here too; tests/integration/test_observability.py runs
Prometheus itself on it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import prometheus_client
import pytest
import yaml

import turbine.mocker.metrics  # noqa: F401 - registers the mocker's gauges
import turbine.worker.worker_metrics  # noqa: F401 - registers the workers' metrics
from turbine.frontend.metrics import FrontendMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/turbine.json"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"

# PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "label_values", "topk", "bottomk",
    "clamp_min", "clamp_max", "abs", "offset", "bool", "delta", "deriv", "time", "vector", "scalar",
}
SERIES_OF = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
ALWAYS_LABELS = {"le", "instance", "job"}  # histogram buckets; Prometheus's own target labels


def turbine_series() -> dict[str, set[str]]:
    """Every series name Turbine's processes expose -> the labels it carries."""
    out: dict[str, set[str]] = {}
    registries = [FrontendMetrics().registry, prometheus_client.REGISTRY]  # frontend + router; workers
    for registry in registries:
        for collector in list(registry._collector_to_names):
            if not hasattr(collector, "_labelnames") or not collector._name.startswith("turbine_"):
                continue
            for suffix in SERIES_OF[collector._type]:
                out[collector._name + suffix] = set(collector._labelnames)
    return out


def vllm_series() -> dict[str, set[str]]:
    """vLLM's metric families, read from the installed vLLM's definitions (its engine registers them
    only when it starts): name -> labels (vLLM labels its engine metrics model_name and engine)."""
    import vllm

    source = "".join(p.read_text() for p in (Path(vllm.__file__).parent / "v1/metrics").glob("*.py"))
    out = {}
    for kind, name in re.findall(r'_(gauge|counter|histogram)_cls\(\s*name="(vllm:[a-z0-9_]+)"', source):
        for suffix in SERIES_OF[kind]:
            out[name + suffix] = {"model_name", "engine"}
    assert len(out) > 40, "vLLM's metric definitions moved: update this reader"
    return out


def expressions(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression reads, and the labels it filters or groups by."""
    labels = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in grouping.split(",") if g.strip()}
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    bare = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", bare)
    words = set(re.findall(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)", bare))
    return {w for w in words if w not in PROMQL_WORDS}, labels


@pytest.fixture(scope="module")
def known() -> dict[str, set[str]]:
    return {**turbine_series(), **vllm_series()}


def test_every_dashboard_query_names_real_metrics_and_labels(known):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 40
    used = set()
    for expr in exprs:
        names, labels = names_and_labels(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - known.keys()
        assert not unknown, f"{expr!r} names metrics no process registers: {sorted(unknown)}"
        allowed = set.union(*(known[n] for n in names)) | ALWAYS_LABELS
        assert labels <= allowed, f"{expr!r} uses labels {sorted(labels - allowed)} its metrics lack"
        used |= names
    # Each part of the system has panels.
    for prefix in ("turbine_frontend_", "turbine_router_", "turbine_worker_", "vllm:"):
        assert any(n.startswith(prefix) for n in used), prefix
    assert {"turbine_frontend_input_sequence_tokens_bucket", "turbine_frontend_output_sequence_tokens_bucket",
            "turbine_router_kv_events_applied_total"} <= used


def test_the_checker_catches_a_wrong_name_or_label(known):
    """A gauge read as a counter, a misspelt name, a label the metric lacks: all refused."""
    for expr, bad in [('rate(turbine_frontend_inflight_requests_total[1m])', "turbine_frontend_inflight_requests_total"),
                      ('turbine_router_kv_events_applied{model="m"}', "turbine_router_kv_events_applied"),
                      ('vllm:num_requests_runing', "vllm:num_requests_runing")]:
        names, _ = names_and_labels(expr)
        assert bad in names and bad not in known
    names, labels = names_and_labels('sum by (worker_id) (turbine_frontend_inflight_requests{model=~"$model"})')
    assert names == {"turbine_frontend_inflight_requests"} and "worker_id" not in known[names.pop()]


def test_dashboard_is_a_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Turbine" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]


def test_scrape_config_has_a_job_per_process_kind():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"turbine-frontend", "turbine-workers", "turbine-router"} <= jobs.keys()
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            assert all(re.fullmatch(r"[\w.-]+:\d+", target) for target in static["targets"])

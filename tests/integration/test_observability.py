"""Observability across real processes: a frontend (KV router) and a mocker worker, both tracing
to a real OTLP/HTTP receiver run by this test (it decodes, with opentelemetry-proto, what the
real OTLP exporters send), logging JSON. One request is one trace across both processes with the
right parent links, joined to the client's `traceparent`; each process's /metrics follows the
type rules (cumulative counts are counters, token counts are histograms too); every log line is
JSON and the access line carries the request id."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.procs import (
    base_env,
    free_port,
    http_text,
    instances_of,
    start_frontend,
    start_mocker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL


class OtlpReceiver:
    """A real OTLP/HTTP traces endpoint: POST /v1/traces, protobuf ExportTraceServiceRequest."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                ok = self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
                if ok:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    with self.lock:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "kind": s.kind,
                            "attrs": {a.key: a.value.string_value or a.value.int_value for a in s.attributes}})

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


STACK: dict = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    receiver = OtlpReceiver()
    tmp = tmp_path_factory.mktemp("observability")
    env = base_env(str(tmp / "discovery"))
    env.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="100",
               TURBINE_LOG_FORMAT="json")
    env.pop("TURBINE_LOG_LEVEL", None)
    worker = start_mocker("mocker", env, tmp, "--otlp-traces-endpoint", receiver.url, "--speedup-ratio", "10")
    frontend = start_frontend("frontend", env, tmp, "--router-mode", "kv", "--otlp-traces-endpoint", receiver.url)
    procs = [worker, frontend]
    try:
        wait_until(lambda: worker_ready(worker) and instances_of(frontend, MODEL) == 1, 60, "the stack", procs)
        STACK.update(env=env, tmp=tmp)  # for tests that start a process of their own
        yield receiver, frontend, worker
    finally:
        stop_all(procs)
        receiver.server.shutdown()


def test_one_trace_across_frontend_and_worker(stack):
    receiver, frontend, _ = stack
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01", "x-request-id": "trace-test-1"})
    assert raw.headers["x-request-id"] == "trace-test-1"
    want = {("turbine-frontend", "POST /v1/chat/completions"), ("turbine-frontend", "preprocess"),
            ("turbine-frontend", "route"), ("turbine-frontend", "first_token"), ("turbine-mocker", "generate")}
    wait_until(lambda: want <= {(s["service"], s["name"]) for s in receiver.of_trace(client_trace)}, 20,
               "the spans of both processes at the OTLP receiver", [frontend])
    spans = {s["name"]: s for s in receiver.of_trace(client_trace)}
    root = spans["POST /v1/chat/completions"]
    assert root["parent"] == client_span and root["attrs"]["turbine.request_id"] == "trace-test-1"
    for name in ("preprocess", "route", "first_token", "generate"):
        assert spans[name]["parent"] == root["id"], name
    # The worker's span is the server side of the request-plane call, under the worker request's id.
    worker_span = spans["generate"]
    assert worker_span["kind"] == 2 and worker_span["attrs"]["turbine.request_id"].startswith("trace-test-1-")


def test_each_request_is_its_own_trace(stack):
    receiver, frontend, _ = stack
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
    ids = []
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=2)
        ids.append(raw.headers["x-request-id"])

    def traces():
        return {s["trace"] for s in receiver.spans if s["attrs"].get("turbine.request_id") in ids}

    wait_until(lambda: len(traces()) == 2, 20, "two traces", [frontend])
    for trace in traces():
        assert {s["service"] for s in receiver.of_trace(trace)} == {"turbine-frontend", "turbine-mocker"}
        assert sum(1 for s in receiver.of_trace(trace) if s["parent"] == "") == 1  # one root


# Cumulative counts that once were gauges: each must stay a counter.
CUMULATIVE = {"turbine_router_kv_events_applied", "turbine_router_kv_event_gaps", "turbine_router_kv_event_recoveries",
              "turbine_router_kv_event_recovery_failures", "turbine_router_load_reports",
              "turbine_frontend_requests", "turbine_frontend_input_tokens", "turbine_frontend_output_tokens",
              "turbine_frontend_cached_tokens", "turbine_frontend_disconnected_clients",
              "turbine_worker_requests", "turbine_worker_errors", "turbine_worker_cancellations"}
TOKEN_HISTOGRAMS = {"turbine_frontend_input_sequence_tokens", "turbine_frontend_output_sequence_tokens"}


def check_types(text: str) -> dict[str, str]:
    """The type rules on one /metrics page; returns {family: type} of Turbine's families."""
    types = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("turbine_"):
            continue
        types[family.name] = family.type
        assert family.type in ("counter", "gauge", "histogram"), family.name
        assert family.documentation, f"{family.name} has no help text"
        if family.type == "gauge":
            # A gauge is a state; a name that reads as a running total belongs to a counter.
            assert not family.name.endswith(("_total", "_count", "_sum")), family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (family.name + "_total", family.name + "_created"), sample.name
            if family.type == "histogram":
                assert sample.name.rsplit("_", 1)[-1] in ("bucket", "count", "sum", "created"), sample.name
    return types


def test_metric_types_on_every_process(stack):
    receiver, frontend, worker = stack
    OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0).completions.create(
        model=MODEL, prompt="count me", max_tokens=3)
    front = check_types(http_text(f"{frontend.url}/metrics"))
    back = check_types(http_text(f"{worker.url}/metrics"))
    seen = {**front, **back}
    for name in CUMULATIVE:
        assert seen.get(name) == "counter", name
    for name in TOKEN_HISTOGRAMS:
        assert front[name] == "histogram", name
    page = http_text(f"{frontend.url}/metrics")
    assert "turbine_frontend_output_sequence_tokens_count" in page and "turbine_frontend_input_sequence_tokens_sum" in page
    # The prompt's length is observed once per finished request, in a bucket by its size.
    count = [s for f in text_string_to_metric_families(page) if f.name == "turbine_frontend_output_sequence_tokens"
             for s in f.samples if s.name.endswith("_count")]
    assert count and count[0].value >= 1


def test_every_log_line_is_json_and_the_access_line_has_the_request_id(stack):
    _, frontend, worker = stack
    client = OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
    client.completions.with_raw_response.create(model=MODEL, prompt="log me", max_tokens=2,
                                                extra_headers={"x-request-id": "log-test-7"})

    def access() -> list[dict]:
        lines = [json.loads(line) for line in frontend.log_path.read_text().splitlines() if line.strip()]
        return [rec for rec in lines if rec["logger"] == "turbine.access" and rec.get("request_id") == "log-test-7"]

    wait_until(lambda: access(), 10, "the access line", [frontend])
    line = access()[0]
    assert line["status"] == 200 and line["path"] == "/v1/completions" and line["level"] == "INFO"
    assert "trace_id" in line  # logged under the request's span
    time.sleep(0.2)
    for proc in (frontend, worker):
        for text in proc.log_path.read_text().splitlines():
            if text.strip():
                record = json.loads(text)  # every line, the engine's and the libraries' too
                assert {"time", "level", "logger", "message"} <= record.keys(), text


def test_prometheus_scrapes_every_process_and_answers_every_dashboard_query(stack, tmp_path):
    """The shipped scrape config (its jobs, targets pointed at this stack) run by a real Prometheus;
    every query of the shipped Grafana dashboard is valid PromQL there, and the panels of the
    frontend, the KV router and the worker have data."""
    import shutil
    import subprocess
    import urllib.parse

    import yaml

    from tests.unit.test_dashboard import DASHBOARD, PROMETHEUS, expressions

    _, frontend, worker = stack
    check = subprocess.run([shutil.which("promtool"), "check", "config", str(PROMETHEUS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["global"]["scrape_interval"] = "1s"
    ports = {"turbine-frontend": frontend.port, "turbine-workers": worker.port}
    config["scrape_configs"] = [dict(job, static_configs=[{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}])
                                for job in config["scrape_configs"] if job["job_name"] in ports]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = subprocess.Popen(
        [shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)

    def query(expr: str) -> dict:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return json.loads(http_text(url))

    try:
        client = OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
        wait_until(lambda: len(query("up == 1")["data"]["result"]) == 2, 30, "Prometheus scraping both targets",
                   [frontend, worker])
        for i in range(4):  # traffic across a few scrapes, so that rates have two samples
            client.completions.create(model=MODEL, prompt=f"the {i} quick brown fox " * 40, max_tokens=3)
            time.sleep(1.2)
        empty = []
        for expr in expressions(json.loads(DASHBOARD.read_text())):
            if expr.startswith("label_values("):
                expr = expr[len("label_values("):].split(",")[0]
            expr = expr.replace("$model", ".*").replace("$__rate_interval", "30s")
            answer = query(expr)
            assert answer["status"] == "success", (expr, answer)
            if not answer["data"]["result"]:
                empty.append(expr)
        for prefix in ("turbine_frontend_requests_total", "turbine_frontend_output_sequence_tokens",
                       "turbine_router_decisions_total", "turbine_worker_requests_total",
                       "turbine_router_worker_kv_active_blocks", "turbine_frontend_inflight_requests"):
            assert not [e for e in empty if prefix in e], (prefix, "\n".join(empty))
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def test_frontend_processes_each_trace_and_log_json(stack):
    """--frontend-processes N: the children are fresh interpreters; each sets up the parent's logging
    and tracing (both reach them through the environment)."""
    receiver, _, _ = stack
    frontend = start_frontend("frontend-procs", STACK["env"], STACK["tmp"], "--frontend-processes", "2",
                              "--otlp-traces-endpoint", receiver.url)
    try:
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 60, "the multi-process frontend", [frontend])
        trace = "6bf92f3577b34da6a3ce929d0e0e4738"
        client = OpenAI(base_url=f"{frontend.url}/v1", api_key="-", max_retries=0)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
        wait_until(lambda: {"POST /v1/completions", "generate"} <= {s["name"] for s in receiver.of_trace(trace)}, 20,
                   "the child's spans", [frontend])
        time.sleep(0.2)
        records = [json.loads(line) for line in frontend.log_path.read_text().splitlines() if line.strip()]
        assert any(r["logger"] == "turbine.access" and r["status"] == 200 for r in records)
    finally:
        stop_all([frontend])

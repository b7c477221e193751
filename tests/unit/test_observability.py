"""Request ids, structured logs and tracing in-process: the frontend's ASGI app (driven by the
official openai client) and a real request-plane server standing in for the worker, with the
OpenTelemetry SDK's in-memory exporter. The end-to-end test with real processes and a real OTLP
receiver is tests/integration/test_observability.py."""

from __future__ import annotations

import io
import json
import logging

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine import logging_setup, tracing
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.http.api import asgi_app
from turbine.logging_setup import JsonFormatter, TextFormatter, logging_choices
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
from turbine.runtime.request_plane import RequestPlaneServer

log = logging.getLogger("turbine.test_worker")


class Worker:
    def __init__(self, tokenizer):
        self.hello = tokenizer.encode(" hello", add_special_tokens=False)
        self.seen: list[str] = []

    async def generate(self, req: GenerateRequest, ctx):
        log.info("generating")  # carries the worker request's id
        self.seen.append(req.request_id)
        yield GenerateOutput(token_ids=self.hello, finish_reason="stop",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(self.hello)))


@pytest.fixture
def lines():
    """JSON log lines of every turbine logger during the test."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("turbine")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), "test")
    yield exporter
    tracing.uninstall()


@pytest.fixture
async def stack(tokenizer):
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    frontend = Frontend(FrontendConfig())
    frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="-", http_client=http, max_retries=0)
    yield worker, client, http
    await client.close()
    await frontend.client.close()
    await server.stop()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_request_id_generated_echoed_and_in_every_log_line(stack, lines):
    worker, client, http = stack
    raw = await client.chat.completions.with_raw_response.create(**CHAT)
    request_id = raw.headers["x-request-id"]
    assert len(request_id) == 32
    # The OpenAI id names it, and the worker's request is the same id.
    assert raw.parse().id == f"chatcmpl-{request_id}" and worker.seen == [request_id]
    logged = lines()
    access = [rec for rec in logged if rec["logger"] == "turbine.access"]
    assert len(access) == 1 and access[0]["request_id"] == request_id
    assert access[0]["status"] == 200 and access[0]["path"] == "/v1/chat/completions" and access[0]["duration_ms"] > 0
    on_worker = [rec for rec in logged if rec["logger"] == "turbine.test_worker"]
    assert [rec["request_id"] for rec in on_worker] == [request_id]


async def test_probes_log_their_access_lines_at_debug(stack, lines):
    # `turbine serve` polls /health twice a second while its engine starts: those lines stay out of the INFO log.
    worker, client, http = stack
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/live")).status_code == 200
    await http.get("/v1/models")
    assert [rec["path"] for rec in lines() if rec["logger"] == "turbine.access"] == ["/v1/models"]
    logging.getLogger("turbine").setLevel(logging.DEBUG)
    await http.get("/health")
    assert [(rec["path"], rec["level"]) for rec in lines() if rec["logger"] == "turbine.access"][-1] == ("/health", "DEBUG")


async def test_client_request_id_is_taken_and_echoed(stack, lines):
    worker, client, http = stack
    raw = await client.chat.completions.with_raw_response.create(**CHAT, extra_headers={"X-Request-Id": "abc-1.2:3"})
    assert raw.headers["x-request-id"] == "abc-1.2:3"
    # Clients may reuse ids: the worker's is made unique, and starts with the client's.
    assert worker.seen[0].startswith("abc-1.2:3-") and raw.parse().id == f"chatcmpl-{worker.seen[0]}"
    assert {rec["request_id"] for rec in lines() if rec["logger"] == "turbine.test_worker"} == {worker.seen[0]}
    # Streamed too, and on any route.
    resp = await http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "s1"})
    assert resp.headers["x-request-id"] == "s1" and "data: [DONE]" in resp.text
    assert (await http.get("/v1/models", headers={"x-request-id": "m1"})).headers["x-request-id"] == "m1"


@pytest.mark.parametrize("bad", ["a" * 129, "has space", "new\nline", "quote\"", "é"])
async def test_bad_client_request_id_is_a_400_naming_the_header(stack, bad):
    _, _, http = stack
    resp = await http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": bad.encode("utf-8")})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Request-Id"
    assert len(resp.headers["x-request-id"]) == 32  # a generated one, for the log line of the refusal


async def test_one_trace_per_request_with_parent_links(stack, spans):
    worker, client, http = stack
    parent_trace, parent_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    resp = await http.post("/v1/chat/completions", json=CHAT,
                           headers={"traceparent": f"00-{parent_trace}-{parent_span}-01"})
    assert resp.status_code == 200
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"POST /v1/chat/completions", "preprocess", "route", "first_token", "generate"}
    root = got["POST /v1/chat/completions"]
    assert {f"{s.context.trace_id:032x}" for s in got.values()} == {parent_trace}  # the client's trace
    assert f"{root.parent.span_id:016x}" == parent_span and root.attributes["http.response.status_code"] == 200
    for name in ("preprocess", "route", "first_token", "generate"):
        assert got[name].parent.span_id == root.context.span_id, name
    assert got["route"].attributes["turbine.worker"] == "w"
    # The worker's span came from the trace context in the request frame.
    assert got["generate"].attributes["turbine.request_id"] == worker.seen[0] and got["generate"].kind.name == "SERVER"


async def test_without_traceparent_a_new_trace_starts(stack, spans):
    _, client, _ = stack
    await client.chat.completions.create(**CHAT)
    await client.chat.completions.create(**CHAT)
    traces = {s.context.trace_id for s in spans.get_finished_spans()}
    roots = [s for s in spans.get_finished_spans() if s.parent is None]
    assert len(traces) == 2 and len(roots) == 2


async def test_tracing_off_sends_no_context(stack, monkeypatch):
    """Off (the default), no span is made and no trace context goes on the wire."""
    assert tracing.tracer is None
    sent = []
    from turbine.runtime import request_plane

    real = request_plane._ClientConnection.open_stream
    monkeypatch.setattr(request_plane._ClientConnection, "open_stream",
                        lambda self, stream, endpoint, payload, trace=None: sent.append(trace)
                        or real(self, stream, endpoint, payload, trace))
    _, client, _ = stack
    await client.chat.completions.create(**CHAT)
    assert sent == [None]


def test_log_format_and_level_from_flags_then_env(monkeypatch):
    monkeypatch.delenv("TURBINE_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TURBINE_LOG_FORMAT", raising=False)
    monkeypatch.delenv("TURBINE_LOG", raising=False)
    assert logging_choices([]) == ("info", "text")
    monkeypatch.setenv("TURBINE_LOG_FORMAT", "JSON")
    monkeypatch.setenv("TURBINE_LOG_LEVEL", "warning")
    assert logging_choices(["--other", "x"]) == ("warning", "json")
    assert logging_choices(["--log-format", "text", "--log-level", "DEBUG"]) == ("debug", "text")


def test_bad_log_env_is_a_one_line_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("TURBINE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit) as exc:
        logging_choices([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "TURBINE_LOG_FORMAT='xml'" in err


def test_formatters_carry_the_request_id():
    record = logging.LogRecord("turbine.x", logging.WARNING, __file__, 1, "hello %s", ("you",), None)
    token = logging_setup.request_id_var.set("r-1")
    try:
        assert TextFormatter().format(record).endswith("WARNING turbine.x: hello you [request_id=r-1]")
        out = json.loads(JsonFormatter().format(record))
    finally:
        logging_setup.request_id_var.reset(token)
    assert out["message"] == "hello you" and out["request_id"] == "r-1" and out["level"] == "WARNING"
    assert "request_id" not in json.loads(JsonFormatter().format(record))


def test_tracing_off_does_not_even_import_opentelemetry():
    """Off, the frontend, the request plane and the mocker never load the OpenTelemetry SDK."""
    import subprocess
    import sys

    code = ("import sys, turbine.frontend.app, turbine.frontend.server, turbine.mocker.worker, turbine.router.service;"
            "from turbine import tracing; assert not tracing.setup_tracing([], 'x');"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_tracing_is_configured_by_the_flag_or_the_standard_variables(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED",
                 "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.configured_endpoint([]) is None
    assert tracing.configured_endpoint(["--otlp-traces-endpoint", "http://c:4317"]) == "http://c:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://base:4317")
    assert tracing.configured_endpoint([]) == "http://base:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert tracing.configured_endpoint([]) == "http://traces:4317"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configured_endpoint(["--otlp-traces-endpoint", "http://c:4317"]) is None


async def test_disaggregated_prefill_hand_off_is_traced(tokenizer, spans):
    """The hand-off is a `prefill` span under the request's; the prefill worker's `generate` and the
    prefill router's `route` are under it, the decode worker's `generate` under the request's."""
    from tests.unit.frontend.dispatch.test_frontend_disagg import Workers, model_with, req, run

    w = Workers(tokenizer)
    try:
        model = model_with(tokenizer, await w.serve(w.decode), [await w.serve(w.prefill)])
        root = tracing.start("request")
        token = tracing.attach(root)
        try:
            text, _, _ = await run(model, req())
        finally:
            tracing.detach(token)
            tracing.end(root)
        assert text == " done"
    finally:
        await w.stop()
    got = spans.get_finished_spans()
    by_parent = {}
    for s in got:
        by_parent.setdefault(s.parent.span_id if s.parent else None, []).append(s.name)
    (prefill,) = [s for s in got if s.name == "prefill"]
    assert sorted(by_parent[root.get_span_context().span_id]) == ["first_token", "generate", "prefill", "route"]
    assert sorted(by_parent[prefill.context.span_id]) == ["generate", "route"]
    assert len({s.context.trace_id for s in got}) == 1


def test_turbine_serve_hands_logging_and_tracing_to_every_child(monkeypatch):
    import socket

    from turbine.serve import build_parser, free_port_from, observability_env

    monkeypatch.delenv("TURBINE_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TURBINE_LOG_FORMAT", raising=False)
    monkeypatch.delenv("TURBINE_LOG", raising=False)
    argv = ["--log-level", "debug", "--log-format", "json", "--otlp-traces-endpoint", "http://c:4317", "--enforce-eager"]
    args, worker_args = build_parser().parse_known_args(argv)
    assert worker_args == ["--enforce-eager"]  # consumed by serve: vLLM's --log-level takes upper case only
    assert observability_env(argv, args) == {"TURBINE_LOG_LEVEL": "debug", "TURBINE_LOG_FORMAT": "json",
                                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}
    args, _ = build_parser().parse_known_args([])
    assert observability_env([], args) == {}  # each child keeps its own environment and defaults
    # The worker's status port: the one asked for, or the next free one.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port_from(port) > port

"""OpenTelemetry tracing, off unless configured: `--otlp-traces-endpoint URL` on any process, or
the standard variables (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; the
protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, `grpc` by default
as vLLM's; OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_* as the SDK
reads them; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off).

One trace per request: the frontend's `http` span (a child of the client's `traceparent`, if
sent) → `preprocess`, `route`, `prefill` (disaggregated hand-off), `first_token` → the worker's
`generate` span (the W3C trace context travels in the request-plane frame: Frame.traceparent /
tracestate) → the engine's spans (vLLM's `llm_request`, given the same context).

When tracing is off `tracer` is None and every helper returns at its first line; the OpenTelemetry
SDK is not even imported. Spans that live across `await`s and generator yields are started with
an explicit parent and ended by hand, never made "current" there (a context attached in an
async generator would be detached in another)."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from turbine.flag_sources import config_file_tokens

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("turbine.tracing")

tracer: Tracer | None = None  # None: tracing off
_provider = None

# A trace context as it travels between processes: (traceparent, tracestate) per W3C Trace Context.
Carrier = tuple[str, str]


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("Tracing").add_argument(
        "--otlp-traces-endpoint", default=None, metavar="URL",
        help="send OpenTelemetry traces to this OTLP endpoint (grpc: host:4317 or http://host:4317; "
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: http://host:4318/v1/traces); default: the "
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables, else off")


def configured_endpoint(argv: list[str] | None) -> str | None:
    """The endpoint `argv`'s flag, its --config file or the environment asks for; None: tracing off."""
    parser = argparse.ArgumentParser(add_help=False)
    add_tracing_args(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(config_file_tokens(argv, ("--otlp-traces-endpoint",)) + argv)
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return None
    return (args.otlp_traces_endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def _protocol() -> str:
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol not in ("grpc", "http/protobuf"):
        raise SystemExit(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: Turbine exports traces over 'grpc' or "
                         f"'http/protobuf'")
    return protocol


def setup_tracing(argv: list[str] | None, service_name: str) -> bool:
    """Start exporting spans if `argv` or the environment configures an endpoint; whether it does."""
    endpoint = configured_endpoint(argv)
    if endpoint is None:
        return False
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if _protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    install(BatchSpanProcessor(exporter), service_name)
    # The same endpoint for child processes (vLLM's engine core reads the variable).
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    log.info("tracing: OTLP spans of %s go to %s (%s)", service_name, endpoint, _protocol())
    return True


def install(processor: Any, service_name: str) -> None:
    """Trace through `processor` (tests give an in-memory exporter's). OTEL_SERVICE_NAME wins."""
    global tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(processor)
    if _provider is None:
        atexit.register(_shutdown)
    else:
        _provider.shutdown()
    _provider = provider
    tracer = provider.get_tracer("turbine")


def uninstall() -> None:
    """Tracing off again (tests)."""
    global tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    tracer = _provider = None


def _shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()  # exports what is still buffered


# -- spans ---------------------------------------------------------------------------------

def start(name: str, parent: Any = None, *, server: bool = False, client: bool = False,
          attributes: dict[str, Any] | None = None) -> Span | None:
    """A span under `parent` (a span, or an OTel Context, or None: the current context); None when
    tracing is off. End it with `end`."""
    if tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and not hasattr(parent, "get_span_context"):
        context = parent  # already a Context
    elif parent is not None:
        context = trace.set_span_in_context(parent)
    else:
        context = None
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
    return tracer.start_span(name, context=context, kind=kind, attributes=attributes)


def end(span: Span | None, error: BaseException | str | None = None) -> None:
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error) if not isinstance(error, str) else error))
    span.end()


def carrier(span: Span | None) -> Carrier | None:
    """`span`'s context to send to another process (None: tracing off or no span)."""
    if span is None:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    return traceparent, ctx.trace_state.to_header() if ctx.trace_state else ""


def extract(traceparent: str | None, tracestate: str | None = "") -> Any:
    """The OTel Context of a received W3C `traceparent` (None: tracing off, or none / malformed
    — a new trace starts then)."""
    if tracer is None or not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers = {"traceparent": traceparent}
    if tracestate:
        headers["tracestate"] = tracestate
    context = TraceContextTextMapPropagator().extract(headers)
    from opentelemetry import trace

    return context if trace.get_current_span(context).get_span_context().is_valid else None


def attach(span: Span | None) -> Any:
    """Make `span` current in this task (a token for `detach`); for code that is not a generator."""
    if span is None:
        return None
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span))


def detach(token: Any) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


def current_carrier() -> Carrier | None:
    """The current span's context (e.g. for the engine's spans); None when off or none."""
    if tracer is None:
        return None
    from opentelemetry import trace

    return carrier(trace.get_current_span())


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span, hex, for log lines; None when off or none."""
    if tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}") if ctx.is_valid else None


def current_span() -> Span | None:
    """The current span (to parent spans started later, across awaits); None when off."""
    if tracer is None:
        return None
    from opentelemetry import trace

    return trace.get_current_span()

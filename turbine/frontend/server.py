"""Runs the frontend app under uvicorn (which handles SIGTERM/SIGINT gracefully): in this process,
or with --frontend-processes N in N child processes that each listen on the same port with
SO_REUSEPORT (the kernel spreads new connections over them), so the HTTP, SSE and detokenizing work
of one port can use N cores. Their metrics add up: the parent gives them one Prometheus multiprocess
directory (turbine/runtime/prometheus_multiprocess.py), so a scrape that any of them answers counts
every process's requests."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket

import uvicorn

from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.http.api import asgi_app
from turbine.runtime.prometheus_multiprocess import MultiprocessDir

log = logging.getLogger("turbine.frontend")

GRACEFUL_SHUTDOWN_S = 30
# How long an idle client connection stays open. Longer than clients keep idle connections for
# reuse (httpx and the openai client: 5 s; proxies and load balancers: commonly 60 s): at uvicorn's
# default of 5 s the server closes a connection just as such a client sends its next request on it,
# and that request fails (ReadError) before it ever reaches the frontend.
KEEP_ALIVE_S = 75


def run_frontend(cfg: FrontendConfig) -> int:
    if cfg.processes > 1:
        return _run_processes(cfg)
    app = asgi_app(Frontend(cfg))
    log.info("OpenAI API on http://%s:%d/v1", cfg.http_host, cfg.http_port)
    uvicorn.run(app, host=cfg.http_host, port=cfg.http_port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S)
    return 0


def reuse_port_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)  # uvicorn's default backlog
    return sock


def _serve_one(cfg: FrontendConfig, index: int) -> None:
    from turbine.logging_setup import setup_logging
    from turbine.tracing import setup_tracing

    setup_logging()  # the parent's flags are in the environment it left (and in sys.argv, as spawn copies it)
    setup_tracing([], "turbine-frontend")  # the parent put the endpoint in the environment
    sock = reuse_port_socket(cfg.http_host, cfg.http_port)
    config = uvicorn.Config(asgi_app(Frontend(cfg)), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S)
    log.info("frontend process %d of %d serving", index + 1, cfg.processes)
    uvicorn.Server(config).run(sockets=[sock])


def _run_processes(cfg: FrontendConfig) -> int:
    """The parent: holds the port (bound, not listening, so a port already taken fails here, once),
    starts the children, passes SIGTERM/SIGINT on, and if one child dies stops the rest and exits 1:
    a frontend that serves some connections and refuses others is not left running."""
    try:
        guard = reuse_port_socket(cfg.http_host, cfg.http_port, listen=False)
    except OSError as exc:
        log.error("--http-port %d on %s: %s", cfg.http_port, cfg.http_host, exc)
        return 1
    metrics_dir = MultiprocessDir()  # in the environment before the children import prometheus_client
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: nothing of this one's state is shared
    procs = [ctx.Process(target=_serve_one, args=(cfg, i), name=f"turbine-frontend-{i}", daemon=False)
             for i in range(cfg.processes)]
    stopping = False

    def stop(signum, _frame):
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn's graceful shutdown

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in procs:
            p.start()
        log.info("OpenAI API on http://%s:%d/v1 (%d processes)", cfg.http_host, cfg.http_port, cfg.processes)
        live = list(procs)
        code = 0
        while live:
            for sentinel in multiprocessing.connection.wait([p.sentinel for p in live]):
                dead = next(p for p in live if p.sentinel == sentinel)
                dead.join()
                live.remove(dead)
                metrics_dir.process_ended(dead.pid)
                if not stopping:
                    log.error("frontend process %s exited (code %s): stopping the others", dead.name, dead.exitcode)
                    code = 1
                    stop(None, None)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        guard.close()
        metrics_dir.close()


def main(argv: list[str] | None = None) -> int:
    from turbine.frontend.args import parse_frontend_args
    from turbine.logging_setup import setup_logging
    from turbine.tracing import configured_endpoint, setup_tracing

    setup_logging(argv, "python -m turbine.frontend")
    cfg = parse_frontend_args(argv)
    if cfg.processes == 1:
        setup_tracing(argv, "turbine-frontend")
    elif endpoint := configured_endpoint(argv):
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint  # each child traces (_serve_one)
    return run_frontend(cfg)

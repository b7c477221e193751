"""Runs the frontend app under uvicorn (which handles SIGTERM/SIGINT gracefully)."""

from __future__ import annotations

import logging

import uvicorn

from turbine.frontend.app import Frontend, FrontendConfig

log = logging.getLogger("turbine.frontend")

GRACEFUL_SHUTDOWN_S = 30
# How long an idle client connection stays open. Longer than clients keep idle connections for
# reuse (httpx and the openai client: 5 s; proxies and load balancers: commonly 60 s): at uvicorn's
# default of 5 s the server closes a connection just as such a client sends its next request on it,
# and that request fails (ReadError) before it ever reaches the frontend.
KEEP_ALIVE_S = 75


def run_frontend(cfg: FrontendConfig) -> None:
    app = Frontend(cfg).app()
    log.info("OpenAI API on http://%s:%d/v1", cfg.http_host, cfg.http_port)
    uvicorn.run(app, host=cfg.http_host, port=cfg.http_port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S)


def main(argv: list[str] | None = None) -> int:
    from turbine.frontend.args import parse_frontend_args
    from turbine.logging_setup import setup_logging

    setup_logging()
    run_frontend(parse_frontend_args(argv))
    return 0

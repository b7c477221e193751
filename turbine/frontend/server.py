"""Runs the frontend app under uvicorn (which handles SIGTERM/SIGINT gracefully)."""

from __future__ import annotations

import logging

import uvicorn

from turbine.frontend.app import Frontend, FrontendConfig

log = logging.getLogger("turbine.frontend")

GRACEFUL_SHUTDOWN_S = 30


def run_frontend(cfg: FrontendConfig) -> None:
    app = Frontend(cfg).app()
    log.info("OpenAI API on http://%s:%d/v1", cfg.http_host, cfg.http_port)
    uvicorn.run(app, host=cfg.http_host, port=cfg.http_port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def main(argv: list[str] | None = None) -> int:
    from turbine.frontend.args import parse_frontend_args
    from turbine.logging_setup import setup_logging

    setup_logging()
    run_frontend(parse_frontend_args(argv))
    return 0

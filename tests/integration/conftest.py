"""Shared real parts for the integration tests: two vLLM CPU workers on the embedded
SmolLM2 model and one frontend, started once per test session (engines are slow to start)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.integration.procs import (
    base_env,
    instances_of,
    start_frontend,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)
from turbine.model.prepare import DEFAULT_MODEL, prepare

MODEL = DEFAULT_MODEL
ENGINE_START_TIMEOUT = 300


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(prepare())


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, model_dir):
    """Frontend + workers A and B (tool-call and reasoning parsers, --enable-prompt-embeds) sharing a
    private file-discovery directory."""
    root = tmp_path_factory.mktemp("cluster")
    env = base_env(str(root / "discovery"))
    # The parsers: hermes tool calls, qwen3 reasoning (output without <think> stays content).
    parsers = ("--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3")
    # Prompt embeddings on too (test_prompt_embeds.py), rather than an engine of their own: token
    # prompts then enter the model as their embedding rows, the same numbers (test_vllm_parity.py).
    workers = [start_worker(n, env, root, *parsers, "--enable-prompt-embeds") for n in ("worker-a", "worker-b")]
    frontend = start_frontend("frontend", env, root)
    procs = [*workers, frontend]
    try:
        wait_until(lambda: all(worker_ready(w) for w in workers), ENGINE_START_TIMEOUT, "workers ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 30, "frontend sees 2 workers", procs)
        yield {"env": env, "root": root, "frontend": frontend, "workers": workers}
    finally:
        stop_all(procs)


@pytest.fixture(scope="session")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster['frontend'].url}/v1", api_key="unused", max_retries=0, timeout=120)

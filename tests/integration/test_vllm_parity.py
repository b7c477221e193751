"""Greedy output through Turbine equals vLLM's own OpenAI server on the same prompt tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import ENGINE_FLAGS, Proc, free_port, http_json, wait_until

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors: red,",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def vllm_server(cluster, model_dir):
    port = free_port()
    log_path = cluster["root"] / "vllm-serve.log"
    popen = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS],
        env=cluster["env"], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    server = Proc("vllm-serve", popen, log_path, port)
    try:
        wait_until(lambda: http_json(f"{server.url}/health")[0] == 200, ENGINE_START_TIMEOUT,
                   "vllm serve ready", [server])
        yield OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        server.stop()


def test_greedy_tokens_match_vllm_serve(client, vllm_server, cluster):
    from turbine.frontend.models.tokenizer import TextTokenizer
    from turbine.model.prepare import prepare

    tok = TextTokenizer.from_dir(prepare())
    for text in PROMPTS:
        ids = tok.encode(text)
        ours = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0, logprobs=0)
        theirs = vllm_server.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0,
                                                logprobs=0)
        assert ours.choices[0].text == theirs.choices[0].text, text
        assert ours.choices[0].logprobs.tokens == theirs.choices[0].logprobs.tokens, text
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens
        assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason

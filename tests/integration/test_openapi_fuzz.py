"""schemathesis against a real frontend process (a simulated worker behind it), driven by the
frontend's own OpenAPI document (`GET /openapi.json`). Every operation gets a fixed, small
number of generated requests, valid and schema-violating ones, plus schemathesis's coverage
phase (boundary values, missing fields, undeclared methods). Checked: no 5xx, every status,
content type and body is the documented one, the API key is enforced, every error (an HTTP one
or an SSE error event) is in OpenAI's shape (tests/integration/openapi_fuzz_hooks.py), and the
frontend process is alive and serving afterwards.

TURBINE_FUZZ_EXAMPLES (default 20 per operation) and TURBINE_FUZZ_SEED (default fixed, so CI
is repeatable) widen a run by hand, e.g. TURBINE_FUZZ_EXAMPLES=300 TURBINE_FUZZ_SEED=random."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.procs import base_env, instances_of, start_frontend, start_mocker, wait_until, worker_ready
from turbine.frontend.http.openapi import openapi_document
from turbine.model.prepare import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
API_KEY = "fuzz-key"  # the frontend runs with --api-key: requests without it must get a 401 in OpenAI's shape
EXAMPLES = os.environ.get("TURBINE_FUZZ_EXAMPLES", "20")
SEED = os.environ.get("TURBINE_FUZZ_SEED", "20261126")
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
          "allow_header_conformance,ignored_auth,openai_error_shape")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("openapi-fuzz")
    env = base_env(str(root / "discovery"))
    # A short context and natural output: a valid generated request generates little.
    mocker = start_mocker("fuzz-mocker", env, root, "--speedup-ratio", "0", "--max-model-len", "256",
                          "--natural-output-len", "8")
    frontend = start_frontend("fuzz-frontend", env, root, "--api-key", API_KEY)
    procs = [mocker, frontend]
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1, 30, "frontend sees the mocker", procs)
        yield {"frontend": frontend, "mocker": mocker, "root": root}
    finally:
        for p in procs:
            p.stop()


def test_served_document_is_the_generated_one(fuzz_target):
    r = httpx.get(f"{fuzz_target['frontend'].url}/openapi.json")  # no API key needed
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc == json.loads(json.dumps(openapi_document()))
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    # From the struct: its fields, and unknown ones refused; from validate_sampling: the ranges.
    assert "logit_bias" in chat["properties"] and chat["additionalProperties"] is False
    assert {"type": "number", "minimum": 0, "maximum": 2} in chat["properties"]["temperature"]["anyOf"]
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                                 "/tokenize", "/detokenize", "/v1/models"}


def test_schemathesis_finds_nothing(fuzz_target):
    frontend = fuzz_target["frontend"]
    seed = [] if SEED == "random" else ["--seed", SEED]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.integration.openapi_fuzz_hooks", "TURBINE_FUZZ_MODEL": MODEL,
           "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    cmd = [str(Path(sys.executable).parent / "st"), "run", f"{frontend.url}/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}", "--max-examples", EXAMPLES, *seed, "--checks", CHECKS,
           "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "60",
           "--suppress-health-check", "all", "--warnings", "off", "--report-dir", str(fuzz_target["root"])]
    # Run from the module's temporary folder: schemathesis keeps a cache in its working directory.
    run = subprocess.run(cmd, cwd=fuzz_target["root"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "passed" in run.stdout, run.stdout[-5000:]


def test_frontend_survives_the_fuzzing(fuzz_target):
    """Runs after the fuzzing (same module, defined later): both processes are up, nothing
    escaped as a traceback, and a real request is served."""
    frontend, mocker = fuzz_target["frontend"], fuzz_target["mocker"]
    assert frontend.alive() and mocker.alive(), frontend.log_tail()
    r = httpx.post(f"{frontend.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in frontend.log_path.read_text(errors="replace"), frontend.log_tail(100)


def test_405_names_the_allowed_methods(fuzz_target):
    """Found by schemathesis: a 405 from a Starlette route lost its Allow header (RFC 9110)."""
    r = httpx.request("TRACE", f"{fuzz_target['frontend'].url}/health")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "GET" in r.headers["allow"]
    r = httpx.get(f"{fuzz_target['frontend'].url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


DEEP = _nested(100_000)  # far past any decoder's stack
ONE_MESSAGE = '[{"role": "user", "content": "hi"}]'
NESTED_BODIES = {
    "chat message field": ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", '
                                                    f'"content": "hi", "x": {DEEP}}}]}}'),
    "responses input": ("/v1/responses", f'{{"model": "{MODEL}", "input": [{{"type": "message", "role": "user", '
                                         f'"content": {DEEP}}}]}}'),
    "tokenize tools": ("/tokenize", f'{{"messages": {ONE_MESSAGE}, "tools": [{{"x": {DEEP}}}]}}'),
    "embeddings": ("/v1/embeddings", f'{{"model": "{MODEL}", "input": "hi", "x": {DEEP}}}'),
    # JSON text inside a string: the tool call's arguments are parsed to render the template
    "chat tool-call arguments": ("/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": _nested(5000)}}]}]})),
    "responses function_call arguments": ("/v1/responses", json.dumps({"model": MODEL, "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": _nested(5000)}]})),
}


@pytest.mark.parametrize("name", list(NESTED_BODIES))
def test_deeply_nested_json_is_not_a_500(fuzz_target, name):
    """Found by fuzzing: JSON nested deeper than the decoder's stack (the body, or JSON text in
    a tool call's arguments) raised RecursionError, answered 500. Now a 400 in OpenAI's shape,
    or, for arguments kept as text, the request is served."""
    path, body = NESTED_BODIES[name]
    r = httpx.post(f"{fuzz_target['frontend'].url}{path}", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

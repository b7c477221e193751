"""Health checks per role (issue 33, §3) on simulated workers: the canary runs at start and on /health,
through the worker's own request checks; an operator's payload (--health-check-payload, or its
environment variable with @file) replaces the default, and one the worker refuses makes /health 503
naming why from the start (and says so in the log). The vLLM roles' canaries (prefill as a prefill with
its KV freed, decode, text mode, embeddings) are tested on real engines beside their modules' workers:
test_disagg_vllm.py, test_text_mode.py, test_embeddings.py, test_openai_api.py."""

from __future__ import annotations

import json

from tests.integration.procs import base_env, http_json, start_mocker, stop_all, wait_until


def health(worker) -> tuple[int, dict]:
    return http_json(f"{worker.url}/health", timeout=15)


def test_a_payload_the_worker_refuses_makes_health_503_naming_why_from_the_start(tmp_path):
    env = base_env(str(tmp_path / "discovery"))
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"token_ids": [10 ** 9], "stop": {"max_tokens": 1}}))
    refused = start_mocker("refused", {**env, "TURBINE_HEALTH_CHECK_PAYLOAD": f"@{payload}"}, tmp_path,
                           "--speedup-ratio", "0")
    custom = start_mocker("custom", env, tmp_path, "--speedup-ratio", "0", "--health-check-payload",
                          json.dumps({"token_ids": [5, 6, 7], "stop": {"max_tokens": 2}}))
    procs = [refused, custom]
    try:
        wait_until(lambda: "health check failed at start" in refused.log_path.read_text(), 60,
                   "the refused worker's first check", procs)
        status, body = health(refused)
        assert status == 503 and body["status"] == "unhealthy"
        assert body["reason"].endswith("canary generate refused (the --health-check-payload payload): token id "
                                       "out of vocabulary (size 49152)"), body
        assert "health check failed at start" in refused.log_path.read_text()
        wait_until(lambda: "health check passed" in custom.log_path.read_text(), 60, "the custom payload's check",
                   procs)
        assert health(custom) == (200, {"status": "healthy"})
    finally:
        stop_all(procs)

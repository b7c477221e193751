"""The vLLM worker on CPU cannot sleep: /engine/sleep on the shared cluster's real worker is
refused (501, naming why) and changes nothing: the worker stays registered, awake and serving."""

from tests.integration.conftest import MODEL
from tests.integration.procs import http_json, instances_of
from tests.integration.test_sleep_wake import post


def test_sleep_is_refused_by_a_cpu_vllm_worker_and_changes_nothing(cluster, client):
    worker, frontend = cluster["workers"][0], cluster["frontend"]
    status, body = post(f"{worker.url}/engine/sleep", {"level": 1})
    assert status == 501, body
    assert "cannot sleep: vLLM's cpu platform has no sleep mode" in body["message"]
    assert http_json(f"{worker.url}/engine/is_sleeping")[1]["is_sleeping"] is False
    assert instances_of(frontend, MODEL) == 2
    assert http_json(f"{worker.url}/health")[0] == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2

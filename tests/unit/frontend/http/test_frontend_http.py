"""The http stage in-process, with the official openai client talking to the frontend's ASGI
app and a real request-plane server standing in for the worker: every worker error code
reaches the client as its documented status (and as an SSE error event once a stream has
started), auth and body limits hold, and a good request streams and completes."""

from __future__ import annotations

import asyncio
import gc

import httpx
import openai
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.http.api import asgi_app
from turbine.protocol import errors as codes
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.runtime.request_plane import RequestPlaneServer

# The worker's error code -> the HTTP status the client sees (docs/architecture.md).
STATUS_OF = {
    codes.INVALID_REQUEST: 400,
    codes.OVERLOADED: 503,
    codes.SHUTTING_DOWN: 503,
    codes.ENGINE_FAILURE: 502,
    codes.KV_TRANSFER_FAILED: 502,
    codes.CANCELLED: 502,
    codes.UNKNOWN_ENDPOINT: 502,
    codes.INTERNAL: 502,
}


class Worker:
    """Answers "hello" unless told to fail with a code, at once or after the first token."""

    def __init__(self, tokenizer):
        self.hello = tokenizer.encode(" hello", add_special_tokens=False)
        self.fail: str | None = None
        self.after_first = False

    async def generate(self, req: GenerateRequest, ctx):
        if self.fail and self.after_first:
            yield GenerateOutput(token_ids=self.hello)
            await asyncio.sleep(0.1)  # the first token is out before the failure
        if self.fail:
            if self.fail == codes.INVALID_REQUEST:
                raise InvalidRequest("token id out of vocabulary")
            raise RequestFailed(f"failed with {self.fail}", code=self.fail)
        yield GenerateOutput(token_ids=self.hello, finish_reason="stop",
                             usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(self.hello)))


@pytest.fixture
async def stack(tokenizer):
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    frontend = Frontend(FrontendConfig(api_key="sekrit", max_request_bytes=4096))
    frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="sekrit", http_client=http, max_retries=0)
    yield worker, client, http
    await client.close()
    await frontend.client.close()
    await server.stop()


async def test_a_request_streams_and_completes(stack):
    worker, client, _ = stack
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == " hello" and reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-") and reply.usage.completion_tokens == len(worker.hello)
    stream = await client.completions.create(model="m", prompt="hi", stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " hello"
    assert chunks[-1].usage.completion_tokens == len(worker.hello)


@pytest.mark.parametrize("code", sorted(STATUS_OF))
async def test_each_worker_error_code_reaches_the_client_as_its_status(stack, code):
    worker, client, _ = stack
    worker.fail = code
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == STATUS_OF[code]
    error = info.value.body
    assert error["message"] and error["type"]
    if code != codes.INVALID_REQUEST:
        assert error["code"] == code
    with pytest.raises(openai.APIStatusError) as info:  # streamed: still a status, before any chunk
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert info.value.status_code == STATUS_OF[code]


async def test_an_error_after_the_first_token_is_an_sse_error_event(stack):
    worker, _, http = stack
    worker.fail, worker.after_first = codes.ENGINE_FAILURE, True
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = await http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sekrit"})
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line]
    assert '"error"' in events[-2] and '"code":"engine_failure"' in events[-2]
    assert events[-1] == "data: [DONE]"


async def test_auth_limits_and_methods(stack):
    _, _, http = stack
    assert (await http.get("/v1/models")).status_code == 401
    assert (await http.get("/v1/models", headers={"authorization": "Bearer sekrit"})).json()["data"][0]["id"] == "m"
    big = {"model": "m", "prompt": "x" * 5000}
    response = await http.post("/v1/completions", json=big, headers={"authorization": "Bearer sekrit"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    response = await http.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    response = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"},
                               headers={"authorization": "Bearer sekrit"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


async def test_metrics_count_each_finished_requests_prompt_and_output_tokens(stack):
    """The planner's inputs: per finished request, its prompt and generated tokens (histograms
    whose _count is the requests and _sum the tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    worker, client, http = stack
    prompts = []
    for prompt in ("hi", "a somewhat longer prompt than that"):
        reply = await client.completions.create(model="m", prompt=prompt)
        prompts.append(reply.usage.prompt_tokens)
    samples = {(s.name, s.labels.get("model")): s.value
               for f in text_string_to_metric_families((await http.get("/metrics")).text) for s in f.samples
               if not s.labels.get("le")}
    assert samples[("turbine_frontend_input_sequence_tokens_count", "m")] == 2
    assert samples[("turbine_frontend_input_sequence_tokens_sum", "m")] == sum(prompts)
    assert samples[("turbine_frontend_output_sequence_tokens_count", "m")] == 2
    assert samples[("turbine_frontend_output_sequence_tokens_sum", "m")] == 2 * len(worker.hello)


async def test_the_frontend_serves_nothing_before_its_first_discovery_snapshot(tmp_path, model_dir):
    """Startup waits for the first snapshot: a frontend process that began serving before it had read
    discovery would answer 404 for a model that its siblings (--frontend-processes N) serve."""
    from turbine.config import DiscoveryConfig
    from turbine.protocol.discovery import ModelCard
    from turbine.runtime.discovery import Registry
    from turbine.runtime.discovery.file import FileDiscovery

    worker = FileDiscovery(tmp_path, ttl=30, poll_interval=0.05)
    await worker.start()
    try:
        registry = Registry(worker)
        await registry.register_instance(instance("w", "127.0.0.1:1"))
        await registry.register_model(ModelCard(
            name="m", namespace="ns", component="backend", endpoint="generate", instance_id="w",
            tokenizer_path=str(model_dir), context_length=2048, kv_block_size=16, total_kv_blocks=10,
            max_num_seqs=4, max_num_batched_tokens=2048))
        frontend = Frontend(FrontendConfig(discovery=DiscoveryConfig(backend="file", file_dir=str(tmp_path))))
        gc.unfreeze()
        async with frontend.lifespan(None):
            assert {name: len(m.instances) for name, m in frontend.models.models.items()} == {"m": 1}
            # and froze what start-up built (out of later collector passes, as `vllm serve` does)
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        await worker.close()

"""Text mode end to end: a vLLM worker with --use-vllm-tokenizer, registered under its own
served name in the shared cluster's discovery dir, so the shared frontend serves both the
token-mode model (its two workers) and the text-mode one; greedy answers must agree. The text-mode
worker runs with --no-kv-events (the shared frontend routes round-robin, so nothing reads them): its
card then announces no KV-events address."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import instances_of, start_worker, wait_until, worker_ready
from turbine.frontend.models.tokenizer import TextTokenizer

TEXT_MODEL = "smollm2-text"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def text_worker(cluster):
    worker = start_worker("worker-text", cluster["env"], cluster["root"], "--use-vllm-tokenizer",
                          "--served-model-name", TEXT_MODEL, "--no-kv-events")
    try:
        wait_until(lambda: worker_ready(worker), ENGINE_START_TIMEOUT, "text-mode worker ready", [worker])
        wait_until(lambda: instances_of(cluster["frontend"], TEXT_MODEL) == 1, 30, "frontend sees it", [worker])
        yield worker
    finally:
        worker.stop()


def _chat(client, model, stream, **kw):
    args = dict(model=model, messages=CHAT, max_tokens=24, temperature=0, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return text, finish, chunks[-1].usage


def _complete(client, model, stream, **kw):
    args = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, **kw)
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return text, finish, chunks[-1].usage


@pytest.mark.parametrize("call", [_chat, _complete], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_same_answers_and_usage_as_token_mode(client, text_worker, call, stream):
    token_text, token_finish, token_usage = call(client, MODEL, stream)
    text, finish, usage = call(client, TEXT_MODEL, stream)
    assert text and text == token_text
    assert finish == token_finish
    assert (usage.prompt_tokens, usage.completion_tokens) == (token_usage.prompt_tokens,
                                                              token_usage.completion_tokens)


@pytest.mark.parametrize("call", [_chat, _complete], ids=["chat", "completions"])
def test_stop_strings_applied_by_the_engine(client, text_worker, call):
    full, _, _ = call(client, TEXT_MODEL, False)
    stop = full.strip().split()[2]  # a word from the middle of the greedy answer
    for stream in (False, True):
        text, finish, usage = call(client, TEXT_MODEL, stream, stop=[stop])
        assert finish == "stop" and stop not in text and full.startswith(text)
        token_text, _, token_usage = call(client, MODEL, stream, stop=[stop])
        assert text == token_text and usage.completion_tokens == token_usage.completion_tokens
    kept, _, _ = call(client, TEXT_MODEL, False, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.endswith(stop) and full.startswith(kept)


def test_too_long_prompt_is_a_400_from_the_worker(client, text_worker):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=TEXT_MODEL, prompt="hello " * 2100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=TEXT_MODEL, messages=CHAT, max_tokens=10**6)
    # the server keeps serving
    assert _chat(client, TEXT_MODEL, False)[0]


def test_a_token_id_prompt_comes_back_as_text(client, text_worker, model_dir):
    tokens = TextTokenizer.from_dir(model_dir).encode(PROMPT, add_special_tokens=True)
    text_reply = client.completions.create(model=TEXT_MODEL, prompt=tokens, max_tokens=16, temperature=0)
    token_reply = client.completions.create(model=MODEL, prompt=tokens, max_tokens=16, temperature=0)
    assert text_reply.choices[0].text == token_reply.choices[0].text
    assert text_reply.usage.prompt_tokens == len(tokens)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=TEXT_MODEL, prompt=[10**7], max_tokens=2)


def test_logprobs_refused_by_name(client, text_worker):
    with pytest.raises(openai.BadRequestError, match="text mode") as exc:
        client.completions.create(model=TEXT_MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
    assert exc.value.body["param"] == "logprobs"


def test_the_health_canary_is_sent_as_text(text_worker):
    """Issue 33, §3: the text-mode worker's canary goes through its text path (the text "Test"): its
    handler refuses token ids, so token ids would have kept /health at 503."""
    assert "health check passed" in text_worker.log_path.read_text(errors="replace")
    from tests.integration.procs import http_json

    assert http_json(f"{text_worker.url}/health", timeout=30) == (200, {"status": "healthy"})


def test_a_worker_with_no_kv_events_announces_no_kv_events_address(cluster, text_worker):
    """--no-kv-events: no relay and no publisher in the card (routers then know it publishes none); its load
    reports still have an address. The token-mode workers of the same cluster announce theirs."""
    import asyncio

    from turbine.config import DiscoveryConfig, make_registry

    async def cards():
        registry = make_registry(DiscoveryConfig(file_dir=cluster["env"]["TURBINE_DISCOVERY_DIR"]))
        await registry.backend.start()
        try:
            return await registry.list_models()
        finally:
            await registry.backend.close()
    by_model = {}
    for card in asyncio.run(cards()):
        by_model.setdefault(card.name, []).append(card)
    [text] = by_model[TEXT_MODEL]
    assert text.kv_events_address is None and text.load_metrics_address
    assert len(by_model[MODEL]) == 2 and all(c.kv_events_address for c in by_model[MODEL])

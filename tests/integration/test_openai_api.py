"""The OpenAI API through the real frontend and real vLLM CPU workers, driven by the
official `openai` client."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import MODEL
from tests.integration.procs import http_text, metric

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer  # here: at the top it was ~5 s of every xdist worker's collection

    return AutoTokenizer.from_pretrained(model_dir)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming_usage_matches_tokenizer(client, hf_tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    expected_prompt = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_text_equals_non_streamed_text(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    parts, usage, finish = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_streamed_and_not(client, hf_tokenizer):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_max_tokens_with_ignore_eos_generates_exactly(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20
    assert r.choices[0].finish_reason == "length"


def test_stop_string_truncates_and_finishes_with_stop(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0)
    text = base.choices[0].text
    assert "7" in text, text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0,
                                        stop=["7"])
    assert stopped.choices[0].text == text[: text.index("7")]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    c = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 4
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=7,
                                       n=3, logprobs=True)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_sampling_parameters_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=8, temperature=0.7, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
                    "stop_token_ids": [2]})
    assert r.usage.completion_tokens >= 4
    # The same seed gives the same text.
    again = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=8, temperature=0.7, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
                    "stop_token_ids": [2]})
    assert again.choices[0].message.content == r.choices[0].message.content


def test_round_robin_uses_both_workers(client, cluster):
    def served(w):
        return metric(http_text(f"{w.url}/metrics"), "turbine_worker_requests_total")

    before = [served(w) for w in cluster["workers"]]
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    after = [served(w) for w in cluster["workers"]]
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_cancelled_stream_aborts_the_engine_request(client, cluster):
    def worker_counts():
        texts = [http_text(f"{w.url}/metrics") for w in cluster["workers"]]
        return (sum(metric(t, "turbine_worker_cancellations_total") for t in texts),
                sum(metric(t, "turbine_worker_engine_unfinished_requests") for t in texts))

    cancelled_before, _ = worker_counts()
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 5:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        cancelled, unfinished = worker_counts()
        if cancelled == cancelled_before + 1 and unfinished == 0:
            break
        time.sleep(0.2)
    assert (cancelled, unfinished) == (cancelled_before + 1, 0)


def test_worker_status_server(cluster):
    w = cluster["workers"][0]
    assert httpx.get(f"{w.url}/live").status_code == 200
    health = httpx.get(f"{w.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    text = httpx.get(f"{w.url}/metrics").text
    assert "vllm:" in text  # vLLM's own metrics are re-exported
    assert "turbine_worker_total_kv_blocks" in text


def test_frontend_health_and_metrics(cluster, client):
    f = cluster["frontend"]
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, stream=True).close()
    assert httpx.get(f"{f.url}/live").status_code == 200
    assert httpx.get(f"{f.url}/health").json()["models"] == {MODEL: 2}
    text = httpx.get(f"{f.url}/metrics").text
    for name in ("turbine_frontend_requests_total", "turbine_frontend_time_to_first_token_seconds",
                 "turbine_frontend_inter_token_latency_seconds", "turbine_frontend_input_tokens_total",
                 "turbine_frontend_output_tokens_total", "turbine_frontend_inflight_requests"):
        assert name in text, name

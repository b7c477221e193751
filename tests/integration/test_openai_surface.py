"""The rest of the OpenAI surface end to end: the official openai client through the real
frontend to the shared vLLM CPU workers (SmolLM2). logit_bias, continuous usage stats,
batched prompts, echo, suffix, unknown fields (and a second frontend with
--ignore-unknown-fields on the same discovery directory), /tokenize, /detokenize, /version
and the /v1/models fields."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.integration.conftest import MODEL
from tests.integration.procs import instances_of, start_frontend, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def lenient_client(cluster):
    """A second frontend (no engine: cheap) with --ignore-unknown-fields, beside the cluster's."""
    frontend = start_frontend("frontend-lenient", cluster["env"], cluster["root"], "--ignore-unknown-fields")
    try:
        wait_until(lambda: instances_of(frontend, MODEL) == 2, 60, "lenient frontend sees 2 workers", [frontend])
        yield OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120), frontend
    finally:
        frontend.stop()


def test_logit_bias_forces_the_token(client, hf_tokenizer):
    token = hf_tokenizer.encode(" banana", add_special_tokens=False)[0]
    piece = hf_tokenizer.decode([token])
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert piece not in plain.choices[0].text
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == piece * 4
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == piece * 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999999": 5})
    assert info.value.body["param"] == "logit_bias"


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and len(set(counts)) > 2
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_batched_prompts_equal_single_requests(client, hf_tokenizer):
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    singles = [client.completions.create(prompt=p, **kw) for p in PROMPTS]
    for prompt in (PROMPTS, [hf_tokenizer.encode(p) for p in PROMPTS]):
        batch = client.completions.create(prompt=prompt, **kw)
        assert [c.index for c in batch.choices] == [0, 1]
        assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
        assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [s.choices[0].text for s in singles]
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_echo_and_suffix(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True))
    assert streamed == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, suffix="end")
    assert info.value.body["param"] == "suffix"


def test_echo_with_logprobs_has_the_prompts_logprobs(client, hf_tokenizer):
    ids = hf_tokenizer(PROMPTS[0])["input_ids"]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1,
                                       echo=True)
    lp = echoed.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as OpenAI: no context for it
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:len(ids)])
    assert lp.tokens[:len(ids)] == [hf_tokenizer.decode([t]) for t in ids]
    assert lp.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text


def test_unknown_fields_400_and_the_ignore_flag(client, lenient_client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                       extra_body={"frobnicate": True})
    assert info.value.body["param"] == "frobnicate" and "frobnicate" in info.value.body["message"]
    lenient, frontend = lenient_client
    for _ in range(2):
        reply = lenient.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                                extra_body={"frobnicate": True})
        assert reply.choices[0].finish_reason == "length"
    log = frontend.log_path.read_text()
    assert log.count("ignoring the unknown request field 'frobnicate'") == 1
    # the server kept serving
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_tokenize_detokenize_version_and_models(client, cluster, hf_tokenizer, model_dir):
    url = cluster["frontend"].url
    text = "Hello, tokenizer world!"
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == hf_tokenizer(text)["input_ids"] and r["count"] == len(r["tokens"])
    r2 = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    assert r2["tokens"] == hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"] == hf_tokenizer.decode(r["tokens"])
    bad = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [-5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{url}/version").json()["version"]
    entry = client.models.list().data[0].model_dump()
    assert entry["max_model_len"] == r["max_model_len"] > 0
    assert entry["root"] == model_dir and entry["parent"] is None and entry["created"] > 0

"""Every kind of bad input gets its 4xx with an OpenAI-style error body, and the server
keeps serving the next request."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.conftest import MODEL
from tests.integration.procs import start_frontend, wait_until, instances_of

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def chat(**overrides):
    body = dict(CHAT)
    body.update(overrides)
    return json.dumps(body).encode()


CASES = [
    ("malformed json", b'{"model": ', 400, None),
    ("unknown model", chat(model="no-such-model"), 404, "model"),
    ("temperature out of range", chat(temperature=5), 400, "temperature"),
    ("temperature wrong type", chat(temperature="hot"), 400, "temperature"),
    ("top_p zero", chat(top_p=0), 400, "top_p"),
    ("negative max_tokens", chat(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens over context", chat(max_tokens=100000), 400, "max_tokens"),
    ("n too large", chat(n=1000), 400, "n"),
    ("messages missing", json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("empty messages", chat(messages=[]), 400, "messages"),
    ("message without role", chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("image part on a text model", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    ("min_tokens over max_tokens", chat(min_tokens=10), 400, "min_tokens"),
    ("stop token outside vocabulary", chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("empty stop string", chat(stop=[""]), 400, "stop"),
]


@pytest.mark.parametrize("name,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_chat_request(cluster, name, body, status, param):
    url = f"{cluster['frontend'].url}/v1/chat/completions"
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param, err
    # The server still answers a good request.
    ok = httpx.post(url, content=chat(), headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_prompt_over_context_length_names_both_numbers(cluster):
    url = f"{cluster['frontend'].url}/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": "word " * 1900, "max_tokens": 500}, timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "500" in msg and "2048" in msg
    r = httpx.post(url, json={"model": MODEL, "prompt": "word " * 3000}, timeout=30)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]


def test_bad_completion_prompts(cluster):
    url = f"{cluster['frontend'].url}/v1/completions"
    for prompt, param in (([], "prompt"), ([1, -5], "prompt"), ([10**9], "prompt"), (["a", [1]], "prompt")):
        r = httpx.post(url, json={"model": MODEL, "prompt": prompt}, timeout=30)
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"] == param
    assert httpx.post(url, json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200


def test_oversized_body_gets_413(cluster):
    url = f"{cluster['frontend'].url}/v1/chat/completions"
    huge = chat(messages=[{"role": "user", "content": "x" * (9 << 20)}])
    r = httpx.post(url, content=huge, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]


def test_unknown_route_and_method(cluster):
    f = cluster["frontend"]
    r = httpx.get(f"{f.url}/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{f.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_required_when_set(cluster):
    secured = start_frontend("frontend-secured", cluster["env"], cluster["root"], "--api-key", "s3cret")
    try:
        wait_until(lambda: instances_of(secured, MODEL) == 2, 30, "secured frontend sees workers", [secured])
        url = f"{secured.url}/v1/chat/completions"
        assert httpx.post(url, content=chat()).status_code == 401
        wrong = httpx.post(url, content=chat(), headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{secured.url}/v1/models").status_code == 401
        ok = httpx.post(url, content=chat(), headers={"authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200
        # Health and metrics stay open.
        assert httpx.get(f"{secured.url}/health").status_code == 200
        assert httpx.get(f"{secured.url}/metrics").status_code == 200
    finally:
        secured.stop()

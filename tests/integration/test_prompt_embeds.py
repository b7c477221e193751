"""Prompt embeddings end to end: the shared cluster's vLLM workers (started with
--enable-prompt-embeds), its frontend, and the official openai client. Embeddings taken from the
model's own embedding table give the same greedy text as the token prompt; every bad tensor gets
its 400 naming prompt_embeds and the server keeps serving. A model whose workers do not take
embeddings (a mocker this module adds to the cluster's discovery) refuses them."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from safetensors import safe_open
from tokenizers import Tokenizer

from tests.integration.conftest import MODEL
from tests.integration.procs import instances_of, start_mocker, wait_until, worker_ready

MOCK_MODEL = "mock-without-embeds"
PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def embeds_cluster(cluster):
    """The shared cluster, plus a mocker serving another model (its card takes no embeddings)."""
    mocker = start_mocker("mocker-without-embeds", cluster["env"], cluster["root"], "--served-model-name",
                          MOCK_MODEL, "--speedup-ratio", "0")
    try:
        wait_until(lambda: worker_ready(mocker), 60, "mocker ready", [mocker])
        wait_until(lambda: instances_of(cluster["frontend"], MOCK_MODEL) == 1, 30, "frontend sees the mocker",
                   [mocker])
        yield cluster
    finally:
        mocker.stop()


@pytest.fixture(scope="module")
def oai(embeds_cluster, client) -> OpenAI:
    return client


@pytest.fixture(scope="module")
def embedding_table(model_dir) -> torch.Tensor:
    path = next(Path(model_dir).glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        name = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))
        return f.get_tensor(name)


def b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def prompt_ids(model_dir) -> list[int]:
    # What the frontend's completions path sends for the text prompt (special tokens included).
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(PROMPT, add_special_tokens=True).ids


def test_embeddings_of_the_prompt_give_the_token_prompts_greedy_text(oai, embedding_table, model_dir):
    ids = prompt_ids(model_dir)
    by_tokens = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    embeds = b64(embedding_table[ids].clone())
    by_embeds = oai.completions.create(model=MODEL, prompt="", max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"prompt_embeds": embeds})
    assert by_tokens.choices[0].text and by_embeds.choices[0].text == by_tokens.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids) == by_tokens.usage.prompt_tokens
    assert by_embeds.usage.completion_tokens == by_tokens.usage.completion_tokens
    # Streamed, the same text and the worker's prompt length in the usage chunk.
    stream = oai.completions.create(model=MODEL, prompt="", max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"prompt_embeds": embeds})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_tokens.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(ids)
    # Another floating dtype is cast to the model's (float16 rounding may change later tokens,
    # so only that it generates).
    half = oai.completions.create(model=MODEL, prompt="", max_tokens=2, temperature=0,
                                  extra_body={"prompt_embeds": b64(embedding_table[ids].to(torch.float16))})
    assert half.usage.prompt_tokens == len(ids) and half.usage.completion_tokens == 2


class _NotATensor:
    pass


def bad_cases(table: torch.Tensor) -> list[tuple[str, object, str]]:
    hidden = table.shape[1]
    return [
        ("1-D", b64(table[0].clone()), "2-D"),
        ("3-D", b64(table[:6].clone().reshape(2, 3, hidden)), "2-D"),
        ("wrong hidden size", b64(torch.zeros(4, hidden + 1)), "hidden size"),
        ("int dtype", b64(torch.zeros(4, hidden, dtype=torch.int32)), "floating-point"),
        ("a dict, not a tensor", b64({"x": torch.zeros(4, hidden)}), "prompt_embeds"),
        ("a pickle of an object", base64.b64encode(pickle.dumps(_NotATensor())).decode(), "could not be loaded"),
        ("garbage base64", "not base64 at all!!", "base64"),
        ("empty sequence", b64(torch.zeros(0, hidden)), "empty"),
        ("longer than the context", b64(torch.zeros(2048, hidden, dtype=torch.float16)), "context length"),
        ("oversized payload", b64(torch.zeros(2000, hidden)), "--max-prompt-embeds-bytes"),
        ("a list (batch)", [b64(table[:3].clone())], "list"),
    ]


def test_each_bad_tensor_gets_its_400_and_the_server_keeps_serving(oai, embeds_cluster, embedding_table):
    url = f"{embeds_cluster['frontend'].url}/v1/completions"
    for name, value, words in bad_cases(embedding_table):
        r = httpx.post(url, json={"model": MODEL, "prompt": "", "max_tokens": 2, "prompt_embeds": value}, timeout=60)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert "prompt_embeds" in err["message"] and words in err["message"], (name, err)
        ok = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert ok.choices[0].text, name
    # The official client sees the same as a BadRequestError.
    with pytest.raises(openai.BadRequestError, match="hidden size"):
        oai.completions.create(model=MODEL, prompt="", max_tokens=2,
                               extra_body={"prompt_embeds": b64(torch.zeros(3, 7))})


def test_requests_that_cannot_take_prompt_embeds_are_refused(oai, embeds_cluster, embedding_table):
    url = f"{embeds_cluster['frontend'].url}/v1"
    good = b64(embedding_table[:3].clone())
    cases = [
        # the mocker's card does not accept them
        ("completions", {"model": MOCK_MODEL, "prompt": "", "prompt_embeds": good}, "prompt_embeds"),
        # chat takes messages, not embeddings
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "prompt_embeds": good}, "prompt_embeds"),
        # a text prompt and embeddings at once
        ("completions", {"model": MODEL, "prompt": "hi", "prompt_embeds": good}, "prompt"),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{url}/{path}", content=json.dumps({**body, "max_tokens": 2}),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert oai.completions.create(model=MOCK_MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None

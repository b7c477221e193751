"""/v1/embeddings end to end: SmolLM2 served by a pooling vLLM worker (`--runner pooling
--convert embed`, last-token pooling, normalized), its frontend, and the official openai client.
A generating model (a mocker beside it) serves no embeddings; the pooling model serves no chat; a client
that gives up on a long batch has its inputs aborted on the engine (issue 33, §5)."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import ENGINE_START_TIMEOUT, MODEL
from tests.integration.procs import (
    base_env,
    http_text,
    instances_of,
    metric,
    start_frontend,
    start_mocker,
    start_worker,
    stop_all,
    wait_until,
    worker_ready,
)

GENERATOR = "mock-generator"
HIDDEN = 576
# vLLM's own offline LLM(runner="pooling", convert="embed", dtype="float32").embed(["Hello world"]),
# first three numbers, recorded on this machine.
HELLO_WORLD_HEAD = [-0.021525979042053223, 0.009851249866187572, -0.009255190379917622]


@pytest.fixture(scope="module")
def embed_cluster(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("embeddings")
    env = base_env(str(root / "discovery"))
    worker = start_worker("pooling-worker", env, root, "--runner", "pooling", "--convert", "embed",
                          "--dtype", "float32")
    mocker = start_mocker("mocker", env, root, "--served-model-name", GENERATOR, "--speedup-ratio", "0")
    frontend = start_frontend("frontend", env, root)
    procs = [worker, mocker, frontend]
    try:
        wait_until(lambda: worker_ready(worker), ENGINE_START_TIMEOUT, "pooling worker ready", procs)
        wait_until(lambda: instances_of(frontend, MODEL) == 1 and instances_of(frontend, GENERATOR) == 1, 30,
                   "frontend sees both models", procs)
        yield {"frontend": frontend, "worker": worker}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def pooling(embed_cluster):
    return embed_cluster["frontend"]


@pytest.fixture(scope="module")
def oai(pooling) -> OpenAI:
    return OpenAI(base_url=f"{pooling.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_official_client_gets_vllms_embeddings(oai):
    # The client asks for base64 unless told otherwise, and decodes it.
    one = oai.embeddings.create(model=MODEL, input="Hello world")
    [item] = one.data
    assert len(item.embedding) == HIDDEN and item.index == 0
    assert math.isclose(math.fsum(x * x for x in item.embedding), 1.0, rel_tol=1e-4)  # normalized
    assert item.embedding[:3] == pytest.approx(HELLO_WORLD_HEAD, abs=1e-4)
    assert one.usage.prompt_tokens == one.usage.total_tokens == 2
    floats = oai.embeddings.create(model=MODEL, input="Hello world", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(item.embedding, abs=1e-6)
    # A batch: strings and token ids, each embedded on its own, in order.
    batch = oai.embeddings.create(model=MODEL, input=["The capital of France is Paris", "Hello world"])
    assert [d.index for d in batch.data] == [0, 1]
    assert batch.data[1].embedding == pytest.approx(item.embedding, abs=1e-5)
    assert batch.data[0].embedding != pytest.approx(item.embedding, abs=1e-3)
    assert batch.usage.prompt_tokens == 2 + 6


def test_token_id_inputs_embed_like_their_text(oai, model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    hello = tok.encode("Hello world", add_special_tokens=True).ids
    by_text = oai.embeddings.create(model=MODEL, input="Hello world").data[0].embedding
    by_ids = oai.embeddings.create(model=MODEL, input=hello).data[0].embedding
    assert by_ids == pytest.approx(by_text, abs=1e-6)
    two = oai.embeddings.create(model=MODEL, input=[hello, hello[:1]])
    assert two.data[0].embedding == pytest.approx(by_text, abs=1e-5) and two.usage.prompt_tokens == len(hello) + 1


@pytest.mark.parametrize("fields,param", [
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": GENERATOR}, "model"),  # a generating model serves no embeddings
])
def test_bad_embedding_requests_get_a_named_400(oai, pooling, fields, param):
    r = httpx.post(f"{pooling.url}/v1/embeddings", json={"model": MODEL, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert len(oai.embeddings.create(model=MODEL, input="still serving").data[0].embedding) == HIDDEN


def test_the_pooling_model_serves_no_generation(oai):
    with pytest.raises(openai.BadRequestError, match="does not serve chat"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not serve completions"):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_the_pooling_workers_canary_embeds_through_its_handler(pooling, tmp_path_factory):
    """Issue 33, §3: a pooling worker's canary embeds (the tokenizer's BOS token) through its embed handler:
    its start-up check passed."""
    log = next(p for p in tmp_path_factory.getbasetemp().rglob("pooling-worker.log"))
    assert "health check passed" in log.read_text(errors="replace")


def test_a_client_that_gives_up_on_embeddings_has_them_aborted(oai, embed_cluster):
    """32 inputs of ~1,800 tokens (tens of seconds of pooling on this CPU), given up on after 2 s: the engine is
    idle again within 2 s, the worker counts the cancellation and the frontend the client that left."""
    worker, frontend = embed_cluster["worker"], embed_cluster["frontend"]

    def sample() -> dict[str, float]:
        w, f = http_text(f"{worker.url}/metrics"), http_text(f"{frontend.url}/metrics")
        return {"running": metric(w, "vllm:num_requests_running"),
                "unfinished": metric(w, "turbine_worker_engine_unfinished_requests"),
                "cancellations": metric(w, "turbine_worker_cancellations_total"),
                "disconnects": metric(f, "turbine_frontend_disconnected_clients_total")}

    before = sample()
    with pytest.raises(openai.APITimeoutError):
        oai.with_options(timeout=2.0).embeddings.create(model=MODEL, input=["word " * 1800] * 32)
    gave_up = time.monotonic()
    while (now := sample())["running"] or now["unfinished"]:
        assert time.monotonic() - gave_up < 2.0, f"still pooling: {now}"
        time.sleep(0.05)
    assert now["cancellations"] - before["cancellations"] == 1, now
    assert now["disconnects"] - before["disconnects"] == 1, now
    assert len(oai.embeddings.create(model=MODEL, input="still serving").data[0].embedding) == HIDDEN

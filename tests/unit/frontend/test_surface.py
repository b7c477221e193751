"""The rest of the OpenAI surface in-process: the official openai client talks to the frontend's
ASGI app, a real request-plane server stands in for the worker (it answers with the prompt's
last token, so every choice says which prompt it came from). Unknown fields, logit_bias,
continuous usage, user, batched prompts, echo, suffix, /tokenize, /detokenize, /version and
the /v1/models fields."""

from __future__ import annotations

import logging

import httpx
import msgspec
import openai
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.app import Frontend, FrontendConfig
from turbine.frontend.args import parse_frontend_args
from turbine.frontend.http.api import asgi_app
from turbine.frontend.http.utility_routes import VERSION
from turbine.protocol.generate import GenerateOutput, GenerateRequest, SamplingOptions, TopLogprob, Usage
from turbine.runtime.request_plane import RequestPlaneServer


class Worker:
    """Per choice: the prompt's last token, then " end"; records the requests it got."""

    def __init__(self, tokenizer):
        self.end = tokenizer.encode(" end", add_special_tokens=False)
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest, ctx):
        self.requests.append(req)
        for i in range(req.sampling.n):
            out = GenerateOutput(token_ids=[req.token_ids[-1]], index=i)
            if req.output.logprobs is not None:
                out.log_probs, out.top_logprobs = [-0.5], [[TopLogprob(req.token_ids[-1], -0.5)]]
            if i == 0 and req.output.prompt_logprobs is not None:  # as the vLLM worker: once, first
                out.prompt_log_probs = [None] + [-1.0] * (len(req.token_ids) - 1)
                out.prompt_top_logprobs = [[]] + [[TopLogprob(t, -1.0)] for t in req.token_ids[1:]]
            yield out
        for i in range(req.sampling.n):
            yield GenerateOutput(token_ids=self.end, index=i, finish_reason="stop",
                                 usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=1 + len(self.end)))


async def make_stack(tokenizer, **cfg):
    worker = Worker(tokenizer)
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, worker.generate)
    await server.start()
    frontend = Frontend(FrontendConfig(api_key="sekrit", **cfg))
    frontend.models.models["m"] = served(tokenizer, [instance("w", server.address)])
    frontend.models.first_seen["m"] = 1234
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend",
                             headers={"authorization": "Bearer sekrit"})
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="sekrit", http_client=http, max_retries=0)
    http.frontend = frontend  # for tests that add models

    async def close():
        await client.close()
        await frontend.client.close()
        await server.stop()

    return worker, client, http, close


@pytest.fixture
async def stack(tokenizer):
    worker, client, http, close = await make_stack(tokenizer)
    yield worker, client, http
    await close()


@pytest.fixture
async def lenient(tokenizer):
    worker, client, http, close = await make_stack(tokenizer, ignore_unknown_fields=True)
    yield worker, client, http
    await close()


MSG = [{"role": "user", "content": "hi"}]


async def bad_request(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        await call
    assert info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


# -- unknown fields ----------------------------------------------------------------------
async def test_unknown_fields_are_a_400_naming_them(stack):
    _, client, _ = stack
    message = await bad_request(client.chat.completions.create(model="m", messages=MSG,
                                                               extra_body={"frobnicate": 1}), "frobnicate")
    assert "frobnicate" in message
    await bad_request(client.completions.create(model="m", prompt="hi", extra_body={"best_of": 2}), "best_of")
    await bad_request(client.completions.create(model="m", prompt="hi", stream=True,
                                                stream_options={"include_usage": True, "x": 1}),
                      "stream_options.x")
    reply = await client.chat.completions.create(model="m", messages=MSG)  # the server keeps serving
    assert reply.choices[0].finish_reason == "stop"


async def test_ignore_unknown_fields_drops_them_with_one_warning_per_name(lenient, caplog):
    worker, client, _ = lenient
    with caplog.at_level(logging.WARNING, logger="turbine.frontend"):
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=MSG, max_tokens=5,
                                                         extra_body={"zzunknown_a": 1, "stream_options": None})
            assert reply.choices[0].finish_reason == "stop"
        await client.completions.create(model="m", prompt="hi", stream=True,
                                        stream_options={"include_usage": True, "zzunknown_b": 2})
    warned = [r.getMessage() for r in caplog.records if "ignoring the unknown request field" in r.getMessage()]
    assert sum("'zzunknown_a'" in w for w in warned) == 1
    assert sum("'stream_options.zzunknown_b'" in w for w in warned) == 1
    assert worker.requests[0].stop.max_tokens == 5  # the known fields still count
    # A known field with a wrong type is still a 400 naming it.
    await bad_request(client.chat.completions.create(model="m", messages=MSG, extra_body={"n": "x", "q": 1}), "n")


def test_the_flag_and_its_env():
    assert parse_frontend_args(["--ignore-unknown-fields"]).ignore_unknown_fields
    assert not parse_frontend_args([]).ignore_unknown_fields


# -- logit_bias ----------------------------------------------------------------------------
async def test_logit_bias_reaches_the_worker_as_token_ids(stack):
    worker, client, _ = stack
    await client.chat.completions.create(model="m", messages=MSG, logit_bias={"42": 100, "7": -50.5})
    await client.completions.create(model="m", prompt="hi", logit_bias={"9": 1})
    assert worker.requests[0].sampling.logit_bias == {42: 100.0, 7: -50.5}
    assert worker.requests[1].sampling.logit_bias == {9: 1.0}
    # on the wire too: token ids as msgpack integer keys
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(worker.requests[0]), type=GenerateRequest)
    assert wire.sampling.logit_bias == {42: 100.0, 7: -50.5}


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {"49152": 1}, {"5": 101}, {"5": -100.5}, {"5": "a"}])
async def test_bad_logit_bias_is_a_400(stack, bias):
    _, client, _ = stack
    await bad_request(client.chat.completions.create(model="m", messages=MSG, logit_bias=bias), "logit_bias")


def test_vllm_worker_maps_logit_bias():
    pytest.importorskip("vllm")
    from turbine.vllm.handlers import sampling_kwargs, sampling_params

    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2],
                          sampling=SamplingOptions(logit_bias={5: 100.0}))
    assert sampling_params(sampling_kwargs(req, {}, 512)).logit_bias == {5: 100.0}


# -- stream_options.continuous_usage_stats ---------------------------------------------------
async def test_continuous_usage_on_every_chunk(stack):
    _, client, _ = stack
    for create in (lambda **kw: client.chat.completions.create(messages=MSG, **kw),
                   lambda **kw: client.completions.create(prompt="hi", **kw)):
        stream = await create(model="m", stream=True,
                              stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = [c async for c in stream]
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.total_tokens - chunks[-1].usage.prompt_tokens
        assert counts[-1] > 0 and chunks[-1].choices == []
        # without it: usage only on the last chunk
        stream = await create(model="m", stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_stream_options_need_stream_and_continuous_needs_include_usage(stack):
    _, client, _ = stack
    await bad_request(client.completions.create(model="m", prompt="hi", stream_options={"include_usage": True}),
                      "stream_options")
    await bad_request(client.completions.create(model="m", prompt="hi", stream=True,
                                                stream_options={"continuous_usage_stats": True}),
                      "stream_options.continuous_usage_stats")


# -- user --------------------------------------------------------------------------------------
async def test_user_is_written_in_the_request_debug_log(stack, caplog):
    _, client, _ = stack
    with caplog.at_level(logging.DEBUG, logger="turbine.frontend"):
        await client.chat.completions.create(model="m", messages=MSG, user="alice-42")
    assert any("alice-42" in r.getMessage() for r in caplog.records)


# -- batched prompts ---------------------------------------------------------------------------
async def test_batched_prompts_whole_and_streamed(stack, tokenizer):
    worker, client, _ = stack
    last = [tokenizer.decode([tokenizer.encode(p)[-1]]) for p in ("one", "two", "three")]
    for prompt, n in ((["one", "two", "three"], 2), ([tokenizer.encode(p) for p in ("one", "two", "three")], 1)):
        reply = await client.completions.create(model="m", prompt=prompt, n=n)
        assert [c.index for c in reply.choices] == list(range(3 * n))
        assert [c.text for c in reply.choices] == [last[i] + " end" for i in range(3) for _ in range(n)]
        assert reply.usage.completion_tokens == 3 * n * (1 + len(worker.end))
        assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in ("one", "two", "three"))
        stream = await client.completions.create(model="m", prompt=prompt, n=n, stream=True,
                                                 stream_options={"include_usage": True})
        texts: dict[int, str] = {}
        chunks = [c async for c in stream]
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {c.index: c.text for c in reply.choices}
        assert chunks[-1].usage == reply.usage


async def test_batch_errors_name_the_prompt(stack):
    _, client, _ = stack
    await bad_request(client.completions.create(model="m", prompt=["a", [1, 2]]), "prompt")
    await bad_request(client.completions.create(model="m", prompt=[[1], [49152]]), "prompt")
    await bad_request(client.completions.create(model="m", prompt=["a"] * 65), "prompt")


# -- echo and suffix ---------------------------------------------------------------------------
async def test_echo_prepends_the_prompt(stack, tokenizer):
    _, client, _ = stack
    reply = await client.completions.create(model="m", prompt="Say hi", echo=True, n=2)
    assert [c.text for c in reply.choices] == ["Say hi" + " hi end"] * 2
    ids = tokenizer.encode("Say hi")
    reply = await client.completions.create(model="m", prompt=ids, echo=True)
    assert reply.choices[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    stream = await client.completions.create(model="m", prompt="Say hi", echo=True, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == "Say hi"
    assert "".join(c.choices[0].text for c in chunks) == "Say hi hi end"



async def test_echo_with_logprobs_has_the_prompts_logprobs_first_null(stack, tokenizer):
    worker, client, _ = stack
    ids = tokenizer.encode("Say hi")
    reply = await client.completions.create(model="m", prompt="Say hi", echo=True, logprobs=1, max_tokens=3)
    assert worker.requests[-1].output.prompt_logprobs == 1
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs[:len(ids)] == [None] + [-1.0] * (len(ids) - 1)
    assert lp.token_logprobs[len(ids)] == -0.5  # then the generated tokens'
    assert lp.tokens[:len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 1
    stream = await client.completions.create(model="m", prompt="Say hi", echo=True, logprobs=1, stream=True)
    first = [c async for c in stream][0].choices[0]
    assert first.text == "Say hi" and first.logprobs.token_logprobs == [None] + [-1.0] * (len(ids) - 1)
    # without echo the worker is not asked for the prompt's logprobs
    await client.completions.create(model="m", prompt="Say hi", logprobs=1)
    assert worker.requests[-1].output.prompt_logprobs is None


async def test_suffix_is_refused_by_name(stack):
    _, client, _ = stack
    message = await bad_request(client.completions.create(model="m", prompt="def f(", suffix="return x"), "suffix")
    assert "fill-in-the-middle" in message


# -- utility routes -----------------------------------------------------------------------------
async def test_tokenize_and_detokenize_round_trip(stack, tokenizer):
    _, _, http = stack
    r = await http.post("/tokenize", json={"model": "m", "prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    r = await http.post("/detokenize", json={"model": "m", "tokens": body["tokens"]})
    assert r.json() == {"prompt": tokenizer.decode(body["tokens"], skip_special_tokens=False)}
    r = await http.post("/tokenize", json={"model": "m", "messages": MSG})
    assert r.json()["tokens"] == tokenizer.encode_chat(MSG)
    r = await http.post("/tokenize", json={"prompt": "x", "return_token_strs": True})  # one model: it is the default
    assert r.json()["token_strs"] == [tokenizer.id_to_token(t) for t in r.json()["tokens"]]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"model": "m"}, "prompt"), ("/tokenize", {"model": "m", "prompt": "a", "messages": MSG}, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, "model"), ("/tokenize", {"model": "m", "prompt": "a", "x": 1}, "x"),
    ("/tokenize", {"model": "m", "messages": []}, "messages"),
    ("/detokenize", {"model": "m", "tokens": [-1]}, "tokens"),
    ("/detokenize", {"model": "m", "tokens": [10 ** 6]}, "tokens"), ("/detokenize", {"model": "m"}, "tokens"),
])
async def test_utility_routes_bad_input(stack, path, body, param):
    _, _, http = stack
    r = await http.post(path, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param


async def test_utility_routes_need_the_key_and_version(stack):
    _, _, http = stack
    r = await http.post("/tokenize", json={"model": "m", "prompt": "a"}, headers={"authorization": "Bearer no"})
    assert r.status_code == 401
    r = await http.get("/version")
    assert r.json() == {"version": VERSION} and VERSION != "unknown"


async def test_models_list_fields(stack, tokenizer):
    _, client, _ = stack
    models = await client.models.list()
    entry = models.data[0].model_dump()
    assert entry["id"] == "m" and entry["created"] == 1234 and entry["parent"] is None
    assert entry["max_model_len"] == 2048 and entry["root"] == ""  # the card's model folder (none in this test)


def test_vllm_worker_maps_prompt_logprobs_and_decode_refuses_them():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from turbine.protocol.generate import OutputOptions
    from turbine.runtime.errors import InvalidRequest
    from turbine.vllm.handlers import DecodeHandlers, _prompt_logprobs, sampling_kwargs, sampling_params

    req = GenerateRequest(request_id="x", model="m", token_ids=[1, 2, 3], output=OutputOptions(prompt_logprobs=1))
    assert sampling_params(sampling_kwargs(req, {}, 512)).prompt_logprobs == 1
    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r)  # noqa: E731
    sampled, tops = _prompt_logprobs([1, 2, 3], [None, {2: lp(-2.0, 3), 9: lp(-0.1, 1)}, {3: lp(-0.2, 1)}], 1)
    assert sampled == [None, -2.0, -0.2]
    assert [[(t.token_id, t.logprob) for t in top] for top in tops] == [[], [(9, -0.1)], [(3, -0.2)]]
    remote = GenerateRequest(request_id="x", model="m", token_ids=[1], output=OutputOptions(prompt_logprobs=0),
                             kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        DecodeHandlers._role_kwargs(None, remote, {})


def test_echo_with_logprobs_is_prefilled_where_it_is_decoded():
    from types import SimpleNamespace

    from turbine.frontend.dispatch.disagg import may_prefill_remotely
    from turbine.protocol.generate import OutputOptions

    model = SimpleNamespace(prefill_instances=["p0"])
    assert may_prefill_remotely(model, GenerateRequest(request_id="x", model="m", token_ids=[1]))
    assert not may_prefill_remotely(model, GenerateRequest(request_id="x", model="m", token_ids=[1],
                                                           output=OutputOptions(prompt_logprobs=1)))



async def test_text_mode_models_refuse_tokenize_and_echo_of_token_ids(tokenizer):
    worker, client, http, close = await make_stack(tokenizer)
    try:
        frontend = http.frontend
        text = served(tokenizer, [instance("w", "tcp://127.0.0.1:1")])
        text.card = msgspec.structs.replace(text.card, name="t", model_input="text")
        text.name, text.tokenizer = "t", None
        frontend.models.models["t"] = text
        r = await http.post("/tokenize", json={"model": "t", "prompt": "a"})
        assert r.status_code == 400 and "text mode" in r.json()["error"]["message"]
        await bad_request(client.completions.create(model="t", prompt=[1, 2], echo=True), "echo")
        await bad_request(client.completions.create(model="t", prompt="a", logit_bias={"x": 1}), "logit_bias")
    finally:
        await close()

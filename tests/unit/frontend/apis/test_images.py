"""The frontend's /v1/images/generations: the body's checks (each refusal a 400 naming its field), and routing to
the workers whose card says they answer with images only, over the real request plane."""

from __future__ import annotations

import base64

import msgspec
import pytest

from tests.unit.frontend.dispatch.test_dispatch import instance, served
from turbine.frontend.apis.images import image_size, images_generations
from turbine.frontend.errors import RequestError
from turbine.frontend.http.openapi import openapi_document
from turbine.frontend.models.table import ModelTable
from turbine.protocol.discovery import ModelCard
from turbine.protocol.generate import GenerateOutput, GenerateRequest, Usage
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer

PNG = b"\x89PNG\r\n\x1a\n-not-really-decoded-here"


def card(iid: str, modalities) -> ModelCard:
    return ModelCard(name="m", namespace="ns", component="backend", endpoint="generate", instance_id=iid,
                     tokenizer_path="", context_length=0, kv_block_size=16, total_kv_blocks=0, max_num_seqs=1,
                     max_num_batched_tokens=0, model_input="text", output_modalities=modalities)


def table(tokenizer, *workers) -> ModelTable:
    """One model "m" served by `workers`: (instance id, address, output modalities or None)."""
    models = ModelTable(registry=None, make_router=None)
    model = served(None, [instance(iid, addr) for iid, addr, _ in workers])
    model.card = card(workers[0][0], workers[0][2])
    model.cards = {iid: card(iid, mods) for iid, _, mods in workers}
    models.models["m"] = model
    return models


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": "url"}, "response_format", "b64_json"),
    ({"n": 0}, "n", "between"),
    ({"n": 11}, "n", "between"),
    ({"size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"size": "8192x8192"}, "size", "at most"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"quality": "hd"}, "quality", "unknown"),
])
async def test_bad_bodies_get_a_named_400(fields, param, words):
    models = table(None, ("img", "127.0.0.1:1", ["image"]))
    with pytest.raises(RequestError) as info:
        await images_generations(msgspec.json.encode({"model": "m", "prompt": "a cat", **fields}), models,
                                 client=None)
    assert (info.value.status, info.value.param) == (400, param) and words in info.value.message


async def test_a_text_only_model_is_a_400_naming_it():
    models = table(None, ("txt", "127.0.0.1:1", None), ("txt2", "127.0.0.1:2", ["text"]))
    with pytest.raises(RequestError, match="does not generate images") as info:
        await images_generations(b'{"model": "m", "prompt": "a cat"}', models, client=None)
    assert (info.value.status, info.value.param) == (400, "model")


def test_sizes():
    assert image_size(None) == image_size("auto") == (None, None)
    assert image_size("64x32") == (64, 32)


async def test_only_image_workers_get_image_requests():
    seen: dict[str, list[GenerateRequest]] = {"text": [], "image": []}

    def worker(kind):
        async def generate(req, ctx):
            seen[kind].append(req)
            if kind == "image":
                yield GenerateOutput(token_ids=[], images=[PNG] * req.sampling.n, finish_reason="stop",
                                     usage=Usage(prompt_tokens=0, completion_tokens=0))
            else:
                yield GenerateOutput(token_ids=[], text="hi", finish_reason="stop",
                                     usage=Usage(prompt_tokens=1, completion_tokens=1))
        return generate

    servers = {}
    for kind in ("text", "image"):
        servers[kind] = RequestPlaneServer()
        servers[kind].register("generate", GenerateRequest, worker(kind))
        await servers[kind].start()
    models = table(None, ("t", servers["text"].address, ["text"]), ("i", servers["image"].address, ["text", "image"]))
    client = RequestPlaneClient(connect_timeout=1.0)
    try:
        for _ in range(3):  # a round-robin over both would reach the text worker
            body = await images_generations(
                b'{"model": "m", "prompt": "a cat", "n": 2, "size": "64x32", "seed": 7}', models, client)
            answer = msgspec.json.decode(body)
            assert [base64.b64decode(d["b64_json"]) for d in answer["data"]] == [PNG, PNG]
    finally:
        await client.close()
        for s in servers.values():
            await s.stop()
    assert seen["text"] == [] and len(seen["image"]) == 3
    req = seen["image"][0]
    assert (req.text.prompt, req.sampling.n, req.sampling.seed) == ("a cat", 2, 7)
    assert (req.image.width, req.image.height) == (64, 32)


def test_the_route_is_in_the_openapi_document():
    doc = openapi_document()
    assert "ImageGenerationRequest" in str(doc["paths"]["/v1/images/generations"])


def test_cards_without_modalities_answer_text_and_stay_wire_compatible():
    plain = card("x", None)
    assert plain.modalities == ["text"]
    assert b"output_modalities" not in msgspec.json.encode(plain)  # old frontends see the card they knew
    assert msgspec.json.decode(msgspec.json.encode(card("x", ["image"])), type=ModelCard).modalities == ["image"]


async def test_the_openai_client_gets_images_and_named_400s_through_the_http_stage():
    """The route through the frontend's ASGI app with the official client: b64_json PNGs from an image worker;
    a text-only model and `response_format: url` are 400s naming the field."""
    import httpx
    import openai

    from turbine.frontend.app import Frontend, FrontendConfig
    from turbine.frontend.http.api import asgi_app

    async def generate(req, ctx):
        yield GenerateOutput(token_ids=[], images=[PNG] * req.sampling.n, finish_reason="stop")

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, generate)
    await server.start()
    frontend = Frontend(FrontendConfig())
    frontend.models.models.update(table(None, ("i", server.address, ["image"])).models)
    text_only = table(None, ("t", "127.0.0.1:1", None)).models["m"]
    text_only.name = text_only.card.name = "chatty"
    frontend.models.models["chatty"] = text_only
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="x", http_client=http, max_retries=0)
    try:
        reply = await client.images.generate(model="m", prompt="a cat", n=2, size="256x256",
                                             response_format="b64_json")
        assert [base64.b64decode(d.b64_json) for d in reply.data] == [PNG, PNG]
        for kwargs, param in (({"model": "chatty"}, "model"), ({"model": "m", "response_format": "url"},
                                                                 "response_format")):
            with pytest.raises(openai.BadRequestError) as info:
                await client.images.generate(prompt="a cat", **kwargs)
            assert info.value.body["param"] == param
    finally:
        await client.close()
        await frontend.client.close()
        await server.stop()


async def test_a_chat_with_an_image_only_model_gets_image_parts_with_data_urls():
    """Streamed and not, through the official client; completions for that model are a 400 naming it."""
    import httpx
    import openai

    from turbine.frontend.app import Frontend, FrontendConfig
    from turbine.frontend.http.api import asgi_app

    asked = []

    async def generate(req, ctx):
        asked.append(req)
        yield GenerateOutput(token_ids=[], images=[PNG] * req.sampling.n, finish_reason="stop")

    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, generate)
    await server.start()
    frontend = Frontend(FrontendConfig())
    frontend.models.models.update(table(None, ("i", server.address, ["image"])).models)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(frontend)), base_url="http://frontend")
    client = openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="x", http_client=http, max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    messages = [{"role": "user", "content": "draw a cat"}]
    try:
        reply = await client.chat.completions.create(model="m", messages=messages)
        assert reply.choices[0].message.content == [{"type": "image_url", "image_url": {"url": url}}]
        assert reply.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.content == [{"type": "image_url", "image_url": {"url": url}}]
        assert chunks[-1].choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="m", prompt="a cat")
        assert info.value.body["param"] == "model" and "images only" in info.value.body["message"]
    finally:
        await client.close()
        await frontend.client.close()
        await server.stop()
    assert [r.text.messages for r in asked] == [messages, messages] and all(r.image is not None for r in asked)

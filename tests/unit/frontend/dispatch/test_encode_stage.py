"""The frontend's encode hand-off (turbine/frontend/dispatch/encode.py), with real request-plane servers standing in for
encode workers: when it asks one, what it puts on the request, which worker an image goes to, that a failed
worker is passed over and none left means the workers encode themselves, that a refused image is the client's
400, and that discovery files encode workers apart from the model's generating workers."""

from __future__ import annotations

import pytest

from tests.unit.frontend.dispatch.test_frontend_disagg import card, record
from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.dispatch.encode import remote_encode, wants_remote_encode
from turbine.frontend.errors import RequestError
from turbine.frontend.models.table import ModelTable, ServedModel
from turbine.protocol.encode import ENCODE_ENDPOINT, IMAGE_ENCODE, EncodeReply, EncodeRequest
from turbine.protocol.generate import GenerateRequest, ImageEmbedding, ImageInput
from turbine.router.policy import RoundRobinRouter
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer


def request(*hashes: str) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[1, 2],
                           images=[ImageInput(data=b"x", hash=h) for h in hashes] or None)


def encode_card(iid: str):
    c = card(iid)
    c.endpoint, c.endpoint_types = ENCODE_ENDPOINT, [IMAGE_ENCODE]
    return c


class Encoders:
    def __init__(self):
        self.calls: list[tuple[str, EncodeRequest]] = []
        self.servers: list[RequestPlaneServer] = []

    async def serve(self, name: str, fail: Exception | None = None) -> str:
        async def encode(req: EncodeRequest, ctx):
            self.calls.append((name, req))
            if fail is not None:
                raise fail
            yield EncodeReply(embeddings=[ImageEmbedding(hash=i.hash, dtype="float32", shape=[16, 576],
                                                         path=f"/tmp/{name}/{i.hash}") for i in req.images],
                              encoded=len(req.images))

        server = RequestPlaneServer()
        server.register(ENCODE_ENDPOINT, EncodeRequest, encode)
        await server.start()
        self.servers.append(server)
        return server.address

    async def close(self):
        for s in self.servers:
            await s.stop()


def model(encoders: list[str], takes: bool = True) -> ServedModel:
    gen = card("gen")
    gen.takes_image_embeddings = takes
    m = ServedModel("m", gen, None, RoundRobinRouter(), instances=[record(gen)], cards={"gen": gen})
    for i, address in enumerate(encoders):
        m.encode_instances.append(record(encode_card(f"enc{i}"), address))
    return m


def test_when_the_frontend_asks_an_encode_worker():
    assert wants_remote_encode(model(["127.0.0.1:1"]), request("aa"))
    assert not wants_remote_encode(model([]), request("aa"))  # no encode worker
    assert not wants_remote_encode(model(["127.0.0.1:1"]), request())  # no image
    assert not wants_remote_encode(model(["127.0.0.1:1"], takes=False), request("aa"))  # a worker takes none


async def test_the_request_carries_where_the_embeddings_are_and_an_image_keeps_its_worker():
    enc = Encoders()
    client = RequestPlaneClient()
    try:
        m = model([await enc.serve("a"), await enc.serve("b")])
        out = await remote_encode(m, client, request("00000001", "ff"), DisaggConfig(image_embedding_transport="file"))
        assert [e.hash for e in out.image_embeddings] == ["00000001", "ff"]
        (name, sent), = enc.calls
        assert sent.transport == "file" and [i.hash for i in sent.images] == ["00000001", "ff"]
        # The first image's hash picks the worker: the same image, the same worker (its cache).
        await remote_encode(m, client, request("00000001"), DisaggConfig())
        await remote_encode(m, client, request("00000002"), DisaggConfig())
        assert [c[0] for c in enc.calls] == [name, name, "b" if name == "a" else "a"]
    finally:
        await client.close()
        await enc.close()


async def test_a_failed_encode_worker_is_passed_over_and_none_left_means_the_workers_encode():
    enc = Encoders()
    client = RequestPlaneClient()
    try:
        broken = await enc.serve("broken", fail=RequestFailed("boom", code="engine_failure"))
        good = await enc.serve("good")
        for order in ([broken, good], [good, broken]):
            out = await remote_encode(model(order), client, request("00000000"), DisaggConfig())
            assert out.image_embeddings is not None
        alone = await remote_encode(model([broken, "127.0.0.1:1"]), client, request("00000000"), DisaggConfig())
        assert alone.image_embeddings is None and alone.images  # the workers have the images and encode them
    finally:
        await client.close()
        await enc.close()


async def test_an_image_the_encode_worker_refuses_is_the_clients_400():
    enc = Encoders()
    client = RequestPlaneClient()
    try:
        refuse = await enc.serve("refuse", fail=InvalidRequest("images[0]: the image cannot be decoded"))
        with pytest.raises(RequestError, match="cannot be decoded"):
            await remote_encode(model([refuse]), client, request("00"), DisaggConfig())
    finally:
        await client.close()
        await enc.close()


async def test_discovery_files_encode_workers_apart_from_the_generating_ones():
    gen, enc = card("gen"), encode_card("enc")

    class Registry:
        pass

    table = ModelTable(Registry(), lambda c: RoundRobinRouter())

    async def tokenizer(c):
        return object()

    table._tokenizer = tokenizer
    await table._apply([record(gen), record(enc)], [gen, enc])
    served = table.models["m"]
    assert [i.instance_id for i in served.instances] == ["gen"]
    assert [i.instance_id for i in served.encode_instances] == ["enc"]
    await table._apply([record(enc)], [enc])  # an encode worker alone serves nothing
    assert "m" not in table.models


def test_the_transport_flag_is_checked():
    with pytest.raises(ValueError, match="image_embedding_transport"):
        DisaggConfig(image_embedding_transport="carrier-pigeon")

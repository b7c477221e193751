"""Disaggregated encode, the worker side without an engine: the embedding file format and its checks, the
encode worker's byte-bounded LRU cache, a NIXL read of a cached buffer, the flags (one role per process), the
vision tower's output shape, and a worker that takes embeddings passing them to its engine's connector (the real
engines: tests/integration/test_multimodal_disagg.py)."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest
import torch
from PIL import Image

from turbine.protocol.encode import ENCODE_ENDPOINT, IMAGE_ENCODE
from turbine.protocol.generate import GenerateRequest, ImageEmbedding, ImageInput
from turbine.runtime.errors import InvalidRequest
from turbine.vllm.args import parse_worker_args
from turbine.vllm.embedding_store import (
    HANDOUT_GRACE_S,
    EmbeddingCache,
    EmbeddingUnavailable,
    NixlReader,
    NixlServer,
    read_file,
    write_file,
)
from tests.unit.vllm.test_worker_images import Engine, png
from turbine.vllm.handlers import HANDLERS_OF_ROLE
from turbine.worker.worker_metrics import WorkerMetrics


def emb(rows=4, width=6, seed=0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def test_a_file_reads_back_only_as_what_it_was_said_to_be(tmp_path):
    t = emb()
    path = str(tmp_path / "x.temb")
    write_file(path, "h1", t)
    told = ImageEmbedding(hash="h1", dtype="float32", shape=[4, 6], path=path)
    assert torch.equal(read_file(told), t)
    for wrong, words in [({"hash": "h2"}, "expected"), ({"shape": [6, 4]}, "expected"),
                         ({"dtype": "float16"}, "expected"), ({"dtype": "int8"}, "dtype"),
                         ({"shape": [24]}, "shape"), ({"path": str(tmp_path / "none")}, "cannot read")]:
        with pytest.raises(EmbeddingUnavailable, match=words):
            read_file(ImageEmbedding(**{**{"hash": "h1", "dtype": "float32", "shape": [4, 6], "path": path}, **wrong}))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-4])  # truncated values
    with pytest.raises(EmbeddingUnavailable, match="bytes of values"):
        read_file(told)
    open(path, "wb").write(b"\x80\x04pickle" + data)  # not ours: never unpickled, refused by its magic
    with pytest.raises(EmbeddingUnavailable, match="not an embedding file"):
        read_file(told)


def test_the_cache_keeps_the_most_recently_used_within_its_bytes(tmp_path):
    one = emb().numel() * 4  # 96 bytes
    cache = EmbeddingCache(capacity_bytes=2 * one, file_dir=str(tmp_path))
    cache.put("a", emb(seed=1))
    cache.put("b", emb(seed=2))
    a_file = cache.location("a", "file").path
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", emb(seed=3))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 2 * one and len(cache) == 2
    cache.put("d", emb(seed=4))  # evicts a, whose file was handed out: it stays for the grace period
    assert cache.get("a") is None and os.path.exists(a_file)
    cache.release_expired(now=time.monotonic() + HANDOUT_GRACE_S + 1)
    assert not os.path.exists(a_file)


def test_a_nixl_reader_gets_the_cached_buffer(tmp_path):
    server = NixlServer("test-encode-unit")
    cache = EmbeddingCache(1 << 20, str(tmp_path), server)
    t = emb(16, 576)
    cache.put("h", t)
    stop = threading.Event()

    def progress():  # the encode worker polls its agent while reads may be in flight
        while not stop.is_set():
            server.poll()
            time.sleep(0.001)

    poller = threading.Thread(target=progress, daemon=True)
    poller.start()
    try:
        where = cache.location("h", "nixl")
        assert where.nixl.length == t.numel() * 4 and where.path is None
        got = NixlReader("test-reader-unit", timeout_s=20).read(where)
        assert torch.equal(got, t)
    finally:
        stop.set()
        poller.join()
        cache.close()


def test_the_encode_worker_serves_the_encode_endpoint_alone():
    cfg = parse_worker_args(["--multimodal-encode-worker", "--embedding-cache-mb", "8"])
    assert cfg.multimodal_encode_worker and cfg.embedding_cache_mb == 8
    assert cfg.endpoint == ENCODE_ENDPOINT and cfg.endpoint_types == (IMAGE_ENCODE,)


@pytest.mark.parametrize("argv, words", [
    (["--multimodal-encode-worker", "--enable-multimodal"], "one role per process"),
    (["--multimodal-encode-worker", "--disaggregation-mode", "decode", "--connector", "nixl"], "one role per process"),
    (["--multimodal-encode-worker", "--embedding-cache-mb", "0"], "--embedding-cache-mb"),
    (["--multimodal-encode-worker", "--encoder-threads", "0"], "--encoder-threads"),
    (["--multimodal-encode-worker", "--embedding-dir", "/no/such/dir"], "no such directory"),
    (["--take-image-embeddings"], "needs --enable-multimodal"),
    (["--embedding-cache-mb", "8"], "an encode worker's setting"),  # would be inert on another worker
    (["--encoder-threads", "2"], "an encode worker's setting"),
])
def test_encode_flags_are_checked(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_the_vision_tower_gives_one_row_per_placeholder(tmp_path, model_dir):
    from tests.multimodal_model import IMAGE_SEQ_LEN, build_vlm
    from turbine.vllm.image_encoder import ImageEncoder

    folder = build_vlm(tmp_path / "vlm", text_model_dir=model_dir)
    enc = ImageEncoder(str(folder), "float32")
    red, blue = (enc.encode(Image.new("RGB", (30, 20), c)) for c in ((200, 0, 0), (0, 0, 200)))
    assert red.shape == (IMAGE_SEQ_LEN, 576) and red.dtype == torch.float32
    assert not torch.equal(red, blue)
    assert torch.equal(red, enc.encode(Image.new("RGB", (30, 20), (200, 0, 0))))


def test_the_encode_workers_canary_runs_the_vision_tower(tmp_path, model_dir, monkeypatch):
    """/health of an encode worker (issue #33 §3): a picture through the encode path, not just liveness."""
    import asyncio

    from tests.multimodal_model import build_vlm
    from turbine.vllm.encode_worker import EncodeEngine
    from turbine.vllm.image_encoder import ImageEncoder

    folder = str(build_vlm(tmp_path / "vlm", text_model_dir=model_dir))
    engine = EncodeEngine(parse_worker_args(["--multimodal-encode-worker", "--model", folder, "--dtype", "float32"]))
    engine.encoder = ImageEncoder(folder, "float32")
    assert asyncio.run(engine.canary()) is None
    monkeypatch.setattr(engine.encoder.connector, "forward", lambda *a, **k: torch.zeros(1, 4, 7))  # a wrong width
    assert "shape (4, 7) for the health check's picture, not (n, 576)" in asyncio.run(engine.canary())

    def broken(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.encoder.vision, "forward", broken)
    assert asyncio.run(engine.canary()) == ("the vision tower failed on the health check's picture: "
                                            "RuntimeError: device lost")


class EmbedEngine(Engine):
    def __init__(self):
        super().__init__()
        self.vllm_config.model_config.get_hidden_size = lambda: 6
        self.params = []

    async def generate(self, prompt, params, request_id, **kwargs):
        self.params.append(params)
        async for out in super().generate(prompt, params, request_id, **kwargs):
            yield out


def embedding_request(shape=(4, 6), hash_="c" * 64) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", token_ids=[1, 2, 3],
                           images=[ImageInput(data=png(), hash="c" * 64)],
                           image_embeddings=[ImageEmbedding(hash=hash_, dtype="float32", shape=list(shape),
                                                            path="/tmp/x.temb")])


def take(take_image_embeddings: bool):
    engine = EmbedEngine()
    metrics = WorkerMetrics({"namespace": "t", "component": "c", "model": "m",
                             "worker_id": f"emb-{take_image_embeddings}"})
    return HANDLERS_OF_ROLE["agg"](engine, metrics, multimodal=True,
                                   take_image_embeddings=take_image_embeddings), engine


async def test_embeddings_reach_the_engines_connector_with_the_images():
    h, engine = take(True)
    [_] = [o async for o in h.generate(embedding_request(), None)]
    params = engine.params[0].extra_args["ec_transfer_params"]["turbine"]
    assert params == [{"hash": "c" * 64, "dtype": "float32", "shape": [4, 6], "path": "/tmp/x.temb"}]
    assert engine.prompts[0]["multi_modal_uuids"] == {"image": ["c" * 64]}  # the images still come


@pytest.mark.parametrize("take_flag, req, words", [
    (False, embedding_request(), "--take-image-embeddings"),
    (True, embedding_request(hash_="d" * 64), "one per image"),
    (True, embedding_request(shape=(4, 7)), "7 wide"),
])
async def test_embeddings_a_worker_cannot_take_are_refused(take_flag, req, words):
    h, engine = take(take_flag)
    with pytest.raises(InvalidRequest, match=words):
        [o async for o in h.generate(req, None)]
    assert not engine.prompts


def test_the_connector_loads_what_requests_brought_and_leaves_a_shape_it_does_not_place_to_the_engine(tmp_path):
    from types import SimpleNamespace

    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from turbine.vllm.ec_connector import TurbineECConnector, ec_transfer_params, engine_config

    config = SimpleNamespace(ec_transfer_config=ECTransferConfig(**engine_config()),
                             model_config=SimpleNamespace(dtype=torch.float32))
    t = emb(4, 6)
    write_file(str(tmp_path / "h.temb"), "h", t)
    write_file(str(tmp_path / "g.temb"), "g", t)
    where = ImageEmbedding(hash="h", dtype="float32", shape=[4, 6], path=str(tmp_path / "h.temb"))
    other = ImageEmbedding(hash="g", dtype="float32", shape=[4, 6], path=str(tmp_path / "g.temb"))

    def req(rid, rows, item):
        return SimpleNamespace(request_id=rid, ec_transfer_params=ec_transfer_params([item]),
                               mm_features=[SimpleNamespace(identifier=item.hash)],
                               get_num_encoder_embeds=lambda i: rows)

    sched = TurbineECConnector(config, ECConnectorRole.SCHEDULER)
    assert sched.is_consumer and not sched.has_cache_item("h")
    good = req("a", 4, where)
    sched.ensure_cache_available(good, 0)
    assert sched.has_cache_item("h") and not sched.has_cache_item("other")  # others: the engine encodes
    sched.update_state_after_alloc(good, 0)
    meta = sched.build_connector_meta(None)
    worker = TurbineECConnector(config, ECConnectorRole.WORKER)
    worker.bind_connector_metadata(meta)
    cache = {}
    worker.start_load_caches(cache)
    assert torch.equal(cache["h"], t)
    also = req("b", 4, where)  # a second request with the same image shares the checked source
    sched.ensure_cache_available(also, 0)
    # The engine places 5 rows for this image: not offered, so the engine encodes it and the request goes on.
    bad = req("c", 5, other)
    sched.ensure_cache_available(bad, 0)
    assert not sched.has_cache_item("g") and sched.take_unavailable_requests() == set()
    sched.request_finished(good)
    assert sched.has_cache_item("h")  # b still holds it
    sched.request_finished(also)
    assert not sched.has_cache_item("h")
    sched.request_finished(bad)
    for _ in range(2):  # the pin outlives the last holder by a step (a load planned just before may still run)
        assert len(list(tmp_path.glob("h.temb.pin-*"))) == 1
        sched.build_connector_meta(None)
    assert list(tmp_path.glob("*.pin-*")) == []


def test_take_image_embeddings_is_refused_on_a_vllm_release_not_checked(monkeypatch, capsys):
    import turbine.vllm.args as args

    assert parse_worker_args(["--enable-multimodal", "--take-image-embeddings"]).take_image_embeddings
    monkeypatch.setattr(args, "VLLM_VERSION", "0.26.0+cu130")
    assert parse_worker_args(["--enable-multimodal", "--take-image-embeddings"]).take_image_embeddings  # GPU release
    monkeypatch.setattr(args, "VLLM_VERSION", "0.29.0")
    with pytest.raises(SystemExit):
        parse_worker_args(["--enable-multimodal", "--take-image-embeddings"])
    assert "--take-image-embeddings: checked with vLLM 0.26, 0.32, 0.33 only" in capsys.readouterr().err


def test_embeddings_gone_before_the_engine_loads_them_are_encoded_or_fail_their_requests_not_the_engine(
        tmp_path, monkeypatch):
    """The encode worker's cache may evict (and, after a grace, delete) what it handed out while a request
    still waits in the engine. A file there when the request is first checked is pinned (a hard link) so no load
    can miss it; one already gone is not offered, and the engine encodes the image itself; a load that fails
    anyway (here: the pin removed under it) gives zeros and fails the requests that brought it, and never
    raises (raising in the model runner would kill the engine and every request in it) - except on a release
    that cannot fail one request from there (0.26), where it raises rather than answer from zeros."""
    from types import SimpleNamespace

    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.v1.outputs import ECConnectorOutput

    import turbine.vllm.ec_connector as ec
    from turbine.vllm.ec_connector import TurbineECConnector, ec_transfer_params, engine_config

    config = SimpleNamespace(ec_transfer_config=ECTransferConfig(**engine_config()),
                             model_config=SimpleNamespace(dtype=torch.float32))

    def where(name):
        t = emb(4, 6)
        write_file(str(tmp_path / f"{name}.temb"), name, t)
        return t, ImageEmbedding(hash=name, dtype="float32", shape=[4, 6], path=str(tmp_path / f"{name}.temb"))

    def req(rid, item):
        return SimpleNamespace(request_id=rid, ec_transfer_params=ec_transfer_params([item]),
                               mm_features=[SimpleNamespace(identifier=item.hash)], get_num_encoder_embeds=lambda i: 4)

    sched = TurbineECConnector(config, ECConnectorRole.SCHEDULER)
    worker = TurbineECConnector(config, ECConnectorRole.WORKER)
    # 1. evicted after the request was checked: the pin keeps it
    t_a, a = where("a")
    ra = req("ra", a)
    sched.ensure_cache_available(ra, 0)
    os.unlink(a.path)  # the encode worker's cache let it go
    sched.update_state_after_alloc(ra, 0)
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    cache = {}
    worker.start_load_caches(cache)
    assert torch.equal(cache["a"], t_a)
    assert worker.build_connector_worker_meta() is None
    # 2. gone before the request was checked: not offered (the engine encodes the image), nothing fails
    _, b = where("b")
    os.unlink(b.path)
    rb = req("rb", b)
    sched.ensure_cache_available(rb, 0)
    assert not sched.has_cache_item("b")
    assert sched.take_unavailable_requests() == set() and sched.build_connector_meta(None).loads == []
    # 3. the load itself fails: zeros, no exception, and the request is failed from the next step on
    _, c = where("c")
    rc = req("rc", c)
    sched.ensure_cache_available(rc, 0)
    sched.update_state_after_alloc(rc, 0)
    meta = sched.build_connector_meta(None)
    for p in tmp_path.glob("c.temb.pin-*"):
        p.unlink()
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(cache)
    assert torch.count_nonzero(cache["c"]) == 0
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta()))
    assert sched.take_unavailable_requests() == {"rc"}
    # 4. the same on a release without the channel: the model runner's error is the engine's
    monkeypatch.setattr(ec, "EC_CAN_FAIL_REQUESTS", False)
    del cache["c"]
    worker.bind_connector_metadata(meta)
    with pytest.raises(RuntimeError, match="cannot fail one request"):
        worker.start_load_caches(cache)


"""The encode worker (`python -m turbine.vllm --multimodal-encode-worker`, issue #19's E/PD and E/P/D): an
engine kind for the worker host that runs only a vision-language model's vision tower and projector
(turbine/vllm/image_encoder.py) and serves the `encode` endpoint: images in (the frontend's checked files and
pixel hashes), for each the location of its embeddings out (a file on this host, or a buffer its NIXL agent
serves; turbine/protocol/encode.py).

Its embedding cache (turbine/vllm/embedding_store.py) keeps embeddings by the image's pixel hash, least
recently used out past --embedding-cache-mb: an image seen before skips the encoder.
`turbine_encoder_images_total` counts the images the encoder ran for, `turbine_embedding_cache_hits_total`
those answered from the cache (both on the status server's /metrics)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import Counter, Gauge

from turbine.model.prepare import tokenizer_folder
from turbine.protocol.encode import ENCODE_ENDPOINT, EncodeReply, EncodeRequest
from turbine.protocol.generate import ImageInput
from turbine.runtime.errors import InvalidRequest
from turbine.runtime.request_plane import RequestPlaneServer
from turbine.runtime.status_server import Health
from turbine.vllm.embedding_store import EmbeddingCache, EmbeddingUnavailable, NixlServer
from turbine.vllm.image_encoder import ImageEncoder
from turbine.vllm.images import decode_images
from turbine.worker.host import Instance
from turbine.worker.worker_metrics import LABELS, WorkerMetrics

log = logging.getLogger("turbine.vllm")

_encoded = Counter("turbine_encoder_images", "images the vision encoder ran for", LABELS)
_cache_hits = Counter("turbine_embedding_cache_hits", "images answered from the embedding cache (no encoder run)",
                      LABELS)
_cache_bytes = Gauge("turbine_embedding_cache_bytes", "bytes of embeddings in the encode worker's cache", LABELS)
# After a NIXL hand-out, poll the agent (UCX completes a consumer's read only while this end progresses): this
# often while reads are outstanding (a consumer notifies when its read is done), less often once none is, until
# this long after the last hand-out (a consumer may read a buffer again, e.g. a decode worker that must compute
# an image's positions itself).
NIXL_POLL_S = 0.002
NIXL_IDLE_POLL_S = 0.02
NIXL_POLL_FOR_S = 30.0


def encoder_dtype(engine_args, model_path: str) -> str:
    """The encoder's dtype from --dtype (vLLM's names), the model's own when auto."""
    dtype = str(getattr(engine_args, "dtype", "auto") or "auto")
    names = {"float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
             "bfloat16": "bfloat16"}
    if dtype in names:
        return names[dtype]
    from transformers import AutoConfig

    config_dtype = str(getattr(AutoConfig.from_pretrained(model_path), "dtype", None) or "float32")
    return names.get(config_dtype.removeprefix("torch."), "float32")


class EncodeEngine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        labels = {"namespace": cfg.namespace, "component": cfg.component, "model": cfg.served_model_name,
                  "worker_id": self.instance_id}
        self.metrics = WorkerMetrics(labels)
        values = [labels[k] for k in LABELS]
        self.encoded = _encoded.labels(*values)
        self.cache_hits = _cache_hits.labels(*values)
        self.cache_bytes = _cache_bytes.labels(*values)
        self.encoder: ImageEncoder | None = None
        self.cache: EmbeddingCache | None = None
        self.nixl: NixlServer | None = None
        self._own_dir: str | None = None
        self._server: RequestPlaneServer | None = None
        self._lock = asyncio.Lock()  # one encoder forward at a time (it uses every core it is given)
        self._poll_until = 0.0
        self._poller: asyncio.Task | None = None
        self._pending_reads = 0
        self._dead: str | None = None

    async def build(self, *, checkpoint: bool) -> None:
        """Nothing: start() loads the encoder."""

    def checkpoint_refusal(self) -> str | None:
        return "the encode worker cannot be checkpointed (it has no engine to put to sleep)"

    async def quiesce(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def resume(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    def restore_identity(self, identity) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def start(self, plane, health: Health) -> list[Instance]:
        cfg = self.cfg
        dtype = encoder_dtype(cfg.engine_args, cfg.model_path)
        import torch

        torch.set_num_threads(cfg.encoder_threads)
        loading = time.monotonic()
        self.encoder = await asyncio.to_thread(ImageEncoder, cfg.model_path, dtype)
        self.metrics.model_load_seconds.set(time.monotonic() - loading)
        directory = cfg.embedding_dir
        if directory is None:
            directory = self._own_dir = tempfile.mkdtemp(prefix="turbine-embeddings-")
        self.nixl = NixlServer(f"turbine-encode-{self.instance_id}")
        self.cache = EmbeddingCache(int(cfg.embedding_cache_mb * (1 << 20)), directory, self.nixl)
        log.info("encode worker: %s vision tower in %s on %s, embedding cache %.0f MiB, files in %s",
                 self.encoder.spec.architecture, dtype, self.encoder.device, cfg.embedding_cache_mb, directory)
        self.on_success = health.succeeded
        server = self._server = cfg.request_plane_config.server(cfg.host, cfg.port)
        server.register(ENCODE_ENDPOINT, EncodeRequest, self.encode)
        card = cfg.model_card(self.instance_id, engine="encoder", tokenizer_path=tokenizer_folder(cfg.model_path),
                              context_length=0, kv_block_size=0, total_kv_blocks=0, max_num_seqs=0,
                              max_num_batched_tokens=0, multimodal=True)
        return [Instance(server, card, metrics=self.metrics)]

    async def encode(self, req: EncodeRequest, ctx) -> AsyncIterator[EncodeReply]:
        if not req.images:
            raise InvalidRequest("images: none to encode")
        if req.transport not in ("nixl", "file"):
            raise InvalidRequest(f"transport {req.transport!r}: choose from nixl, file")
        self.metrics.inflight.inc()
        try:
            encoded = 0
            locations = []
            for item in req.images:
                fresh = await self._embed(item)
                encoded += fresh
                try:
                    locations.append(self.cache.location(item.hash, req.transport))
                except EmbeddingUnavailable as exc:
                    raise InvalidRequest(str(exc)) from None
            if req.transport == "nixl":
                self._keep_polling(len(req.images))
            self.cache_bytes.set(self.cache.bytes)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise
        finally:
            self.metrics.inflight.dec()
        self.metrics.request_done("success")
        self.on_success()
        yield EncodeReply(embeddings=locations, encoded=encoded)

    async def _embed(self, item: ImageInput) -> int:
        """Puts the image's embeddings in the cache; 1 when the encoder ran, 0 on a hit."""
        if self.cache.get(item.hash) is not None:
            self.cache_hits.inc()
            return 0
        async with self._lock:
            if self.cache.get(item.hash) is not None:  # encoded while this one waited
                self.cache_hits.inc()
                return 0
            (image,) = decode_images([item])
            tensor = await asyncio.to_thread(self.encoder.encode, image)
            self.cache.put(item.hash, tensor)
            self.encoded.inc()
            return 1

    def _keep_polling(self, reads: int) -> None:
        self._pending_reads += reads
        self._poll_until = time.monotonic() + NIXL_POLL_FOR_S
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while time.monotonic() < self._poll_until:
            self._pending_reads = max(0, self._pending_reads - self.nixl.poll())
            await asyncio.sleep(NIXL_POLL_S if self._pending_reads else NIXL_IDLE_POLL_S)
        self._pending_reads = 0
        self.cache.release_expired()

    async def canary(self) -> str | None:
        """The encode path itself on a small picture: decoded as a request's image is, then through the vision
        tower and projector (not into the cache, which holds clients' images only)."""
        if self._dead is not None:
            return self._dead
        try:
            (image,) = decode_images([ImageInput(data=canary_png(), hash="health-check")])
            async with self._lock:
                rows = await asyncio.to_thread(self.encoder.encode, image)
        except Exception as exc:  # the check's answer, not the process's end
            return f"the vision tower failed on the health check's picture: {type(exc).__name__}: {exc}"
        if rows.numel() == 0 or rows.shape[-1] != self.encoder.spec.hidden_size:
            return (f"the vision tower gave embeddings of shape {tuple(rows.shape)} for the health check's picture, "
                    f"not (n, {self.encoder.spec.hidden_size})")
        return None

    def failure(self) -> str | None:
        return self._dead

    async def died(self) -> str:
        await asyncio.Event().wait()  # the encoder runs in this process: it dies with it
        return ""

    def refresh_gauges(self) -> None:
        if self.cache is not None:
            self.cache_bytes.set(self.cache.bytes)

    def serving(self) -> None:
        log.info("encode worker %s serving %r at %s", self.instance_id, self.cfg.served_model_name,
                 self._server.address)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.cache is not None:
            self.cache.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def canary_png() -> bytes:
    """A small gray picture, as a client would send one (PNG)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()

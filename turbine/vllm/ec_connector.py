"""TurbineECConnector: vLLM's encoder-cache (EC) connector interface, consumer side, for workers started with
--take-image-embeddings. A request whose GenerateRequest carries `image_embeddings` (an encode worker's
answer: a file path or a NIXL buffer per image) gets them in its sampling extra_args as
`ec_transfer_params = {"turbine": [ImageEmbedding as builtins, ...]}`; vLLM's scheduler then treats those
images' encoder outputs as external (the scheduler half: `has_cache_item`), and the model-runner half loads
them into the engine's encoder cache (`start_load_caches`) instead of running the vision encoder. An image
without one is encoded by the engine as in an aggregated worker.

vLLM loads the class from here (ec_connector_module_path) in its scheduler and model-runner processes."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from turbine.protocol.generate import ImageEmbedding
from turbine.vllm.compat import ECConnectorWorkerMetadata
from turbine.vllm.embedding_store import NixlReader, check_location, read_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("turbine.vllm")

PARAMS_KEY = "turbine"  # ec_transfer_params[PARAMS_KEY]: the request's ImageEmbedding list


def ec_transfer_params(embeddings: list[ImageEmbedding]) -> dict[str, Any]:
    return {PARAMS_KEY: [msgspec.to_builtins(e) for e in embeddings]}


def engine_config() -> dict[str, Any]:
    """vLLM's ECTransferConfig fields for a worker that takes image embeddings."""
    return {"ec_connector": "TurbineECConnector", "ec_role": "ec_consumer",
            "ec_connector_module_path": __name__}


@dataclass
class TurbineECMetadata(ECConnectorMetadata):
    loads: list[dict] = field(default_factory=list)  # ImageEmbedding builtins to load this step


if ECConnectorWorkerMetadata is not None:  # releases without it refuse --take-image-embeddings (args.py)
    @dataclass
    class TurbineECWorkerMeta(ECConnectorWorkerMetadata):
        failed: set[str] = field(default_factory=set)  # image hashes the model runner could not load this step

        def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
            return TurbineECWorkerMeta(self.failed | getattr(other, "failed", set()))


class TurbineECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        self._dtype = vllm_config.model_config.dtype
        # Scheduler half: the embeddings that requests in the engine brought, by image hash, and who brought them.
        self._sources: dict[str, dict] = {}
        self._holders: dict[str, set[str]] = {}
        self._to_load: dict[str, dict] = {}
        self._unavailable: set[str] = set()
        # Model-runner half.
        self._reader: NixlReader | None = None
        self._failed: set[str] = set()

    # ---- scheduler half
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        for item in (request.ec_transfer_params or {}).get(PARAMS_KEY, ()):
            self._sources[item["hash"]] = item
            self._holders.setdefault(item["hash"], set()).add(request.request_id)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._sources

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        image_hash = request.mm_features[index].identifier
        item = self._sources.get(image_hash)
        if item is None:
            return
        rows = request.get_num_encoder_embeds(index)
        if item["shape"][0] != rows:  # the encode worker's model does not match this engine's
            log.error("request %s: image %s: the encode worker sent %s embeddings, the engine places %d",
                      request.request_id, image_hash[:16], item["shape"], rows)
            self._unavailable.add(request.request_id)
            return
        if image_hash in self._to_load:
            return  # another request of this step brought it: one load serves both
        if item.get("path") is not None:
            # Pin the file for this load: a hard link keeps its data however soon the encode worker's cache
            # evicts it, and a file already gone fails this request here, cleanly, before any step uses it.
            pinned = f"{item['path']}.pin-{uuid.uuid4().hex}"
            try:
                os.link(item["path"], pinned)
            except OSError as exc:
                log.error("request %s: image %s: its embeddings are gone (%s); the request fails",
                          request.request_id, image_hash[:16], exc)
                self._unavailable.add(request.request_id)
                return
            item = dict(item, path=pinned)
        self._to_load[image_hash] = item

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = TurbineECMetadata(list(self._to_load.values()))
        self._to_load.clear()
        return meta

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        for item in (request.ec_transfer_params or {}).get(PARAMS_KEY, ()):
            holders = self._holders.get(item["hash"])
            if holders is not None:
                holders.discard(request.request_id)
                if not holders:
                    del self._holders[item["hash"]]
                    self._sources.pop(item["hash"], None)
        return False, None

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        for image_hash in getattr(meta, "failed", ()):  # the model runner could not load them
            self._unavailable |= self._holders.get(image_hash, set())

    # ---- model-runner half
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for item in meta.loads:
            if item["hash"] in encoder_cache:
                _unpin(item)
                continue
            e = msgspec.convert(item, ImageEmbedding)
            try:
                check_location(e)
                tensor = read_file(e) if e.path is not None else self._nixl().read(e)
            except Exception as exc:  # EmbeddingUnavailable, a NIXL error: anything but the engine's death
                # The scheduler has promised these rows to this step's forward pass, and raising here would
                # kill the engine with every request in it. Zeros keep it running; the requests that brought
                # the image are failed by the scheduler half once it hears (the next step): engine_failure to the client.
                log.error("%s: the requests that brought it fail", exc)
                tensor = torch.zeros(e.shape, dtype=self._dtype)
                self._failed.add(e.hash)
            finally:
                _unpin(item)
            encoder_cache[e.hash] = tensor.to(self._dtype)

    def build_connector_worker_meta(self):
        if not self._failed:
            return None
        meta, self._failed = TurbineECWorkerMeta(self._failed), set()
        return meta

    def save_caches(self, encoder_cache, mm_hash: str, **kwargs) -> None:
        return  # a consumer saves nothing

    def _nixl(self) -> NixlReader:
        if self._reader is None:
            self._reader = NixlReader(f"turbine-ec-{os.getpid()}")
        return self._reader


def _unpin(item: dict) -> None:
    """Drop the scheduler half's hard link once the model runner is done with it."""
    path = item.get("path")
    if path is not None and ".pin-" in os.path.basename(path):
        try:
            os.unlink(path)
        except OSError:
            pass

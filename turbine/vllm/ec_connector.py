"""TurbineECConnector: vLLM's encoder-cache (EC) connector interface, consumer side, for workers started with
--take-image-embeddings. A request whose GenerateRequest carries `image_embeddings` (an encode worker's
answer: a file path or a NIXL buffer per image) gets them in its sampling extra_args as
`ec_transfer_params = {"turbine": [ImageEmbedding as builtins, ...]}`; vLLM's scheduler then treats those
images' encoder outputs as external (the scheduler half: `has_cache_item`), and the model-runner half loads
them into the engine's encoder cache (`start_load_caches`, onto the engine's device) instead of running the
vision encoder. An image without one is encoded by the engine as in an aggregated worker.

The scheduler half checks an embedding before it says the engine need not encode the image (in
`ensure_cache_available`, which vLLM asks before it schedules the request): its row count against what the
engine places, and for the file transport that the file is still there, pinned by a hard link for as long as
a request holds it (the encode worker's cache may evict it meanwhile). An embedding that fails the check is
not offered: the engine encodes that image itself, and the request goes on. What can still fail is the
model runner's read (a NIXL peer gone, a damaged file): on releases with the EC worker → scheduler channel
(vLLM 0.28+ for the metadata, 0.30+ to fail a request: 0.32, 0.33 here) that image's requests fail with
`engine_failure` and the engine lives; on 0.26, which has no such channel, the read's error stops the engine
(the worker then unregisters and its requests migrate where migration is on), rather than run a request on
embeddings it does not have.

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
from turbine.vllm.compat import EC_CAN_FAIL_REQUESTS, VLLM_VERSION, ECConnectorWorkerMetadata
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
        self._device = _device_of(vllm_config)
        # Scheduler half: the checked embeddings requests in the engine brought, by image hash, and who brought them.
        self._sources: dict[str, dict] = {}
        self._holders: dict[str, set[str]] = {}
        self._to_load: dict[str, dict] = {}
        self._unavailable: set[str] = set()
        self._steps = 0
        self._unpin_after: list[tuple[int, str]] = []  # (step, pin): unlinked once no load of it can be in flight
        # Model-runner half.
        self._reader: NixlReader | None = None
        self._failed: set[str] = set()

    # ---- scheduler half
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        for item in (request.ec_transfer_params or {}).get(PARAMS_KEY, ()):
            holders = self._holders.setdefault(item["hash"], set())
            if request.request_id in holders:
                continue  # asked again while the request waits
            holders.add(request.request_id)
            if item["hash"] not in self._sources and (checked := self._checked(request, item)) is not None:
                self._sources[item["hash"]] = checked
        return True

    def _checked(self, request: Request, item: dict) -> dict | None:
        """The embedding as this engine can load it (a file: pinned), or None: the engine encodes the image."""
        index = next((i for i, f in enumerate(request.mm_features) if f.identifier == item["hash"]), None)
        if index is None:
            return None  # an embedding for an image the request does not have: nothing to take it for
        rows = request.get_num_encoder_embeds(index)
        if item["shape"][0] != rows:  # the encode worker's model does not match this engine's
            log.error("request %s: image %s: the encode worker sent %s embeddings, the engine places %d: the "
                      "engine encodes it", request.request_id, item["hash"][:16], item["shape"], rows)
            return None
        if item.get("path") is None:
            return item
        # Pin the file while a request holds it: a hard link keeps its data however soon the encode worker's
        # cache evicts it.
        pinned = f"{item['path']}.pin-{uuid.uuid4().hex}"
        try:
            os.link(item["path"], pinned)
        except OSError as exc:
            log.warning("request %s: image %s: its embeddings are gone (%s): the engine encodes it",
                        request.request_id, item["hash"][:16], exc)
            return None
        return dict(item, path=pinned)

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._sources

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        image_hash = request.mm_features[index].identifier
        if (item := self._sources.get(image_hash)) is not None:
            self._to_load[image_hash] = item  # another request of this step may bring it too: one load serves both

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._steps += 1
        while self._unpin_after and self._unpin_after[0][0] <= self._steps:
            _unlink(self._unpin_after.pop(0)[1])
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
                    source = self._sources.pop(item["hash"], None)
                    if source is not None and source.get("path") is not None:
                        # A load planned in the last steps may not have run yet (scheduling runs a step ahead).
                        self._unpin_after.append((self._steps + 2, source["path"]))
        return False, None

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        for image_hash in getattr(meta, "failed", ()):  # the model runner could not load them
            self._unavailable |= self._holders.get(image_hash, set())

    def shutdown(self) -> None:
        for _, path in self._unpin_after:
            _unlink(path)
        for source in self._sources.values():
            if source.get("path") is not None:
                _unlink(source["path"])
        self._unpin_after, self._sources = [], {}

    # ---- model-runner half
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for item in meta.loads:
            if item["hash"] in encoder_cache:
                continue
            e = msgspec.convert(item, ImageEmbedding)
            try:
                check_location(e)
                tensor = read_file(e) if e.path is not None else self._nixl().read(e)
            except Exception as exc:  # EmbeddingUnavailable, a NIXL error: anything but the engine's death
                if not EC_CAN_FAIL_REQUESTS:  # no channel to fail the request: see the module's doc
                    raise RuntimeError(f"{exc}: vLLM {VLLM_VERSION} cannot fail one request from here") from exc
                # The scheduler has promised these rows to this step's forward pass, and raising here would
                # kill the engine with every request in it. Zeros keep it running; the requests that brought
                # the image are failed by the scheduler half once it hears (the next step): engine_failure to the client.
                log.error("%s: the requests that brought it fail", exc)
                tensor = torch.zeros(e.shape, dtype=self._dtype)
                self._failed.add(e.hash)
            encoder_cache[e.hash] = tensor.to(device=self._device, dtype=self._dtype)

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


def _device_of(vllm_config) -> torch.device:
    """Where the engine's encoder cache lives (its model runner's device); CPU for the CPU build."""
    device_config = getattr(vllm_config, "device_config", None)
    device = getattr(device_config, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

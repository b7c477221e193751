"""Turbine's multi-tier KV cache as a vLLM v1 KV connector (`--connector kvbm`, issue #18).

The engine's own KV cache is the fastest tier; this connector keeps every full block it computes
in turbine.kvbm's TieredStore (host memory, a local disk directory, a directory several workers
share) and, when a new request's
prompt continues past what the engine still holds, loads the following blocks from the store into
the engine's blocks before the forward pass instead of recomputing them.

- Block identity is the router's chained hash (turbine.router.hashing: tokens, parent chain,
  adapter), so the same hash names the same KV on every worker of the model; the disk directory is
  namespaced by the model and its KV layout, so two models never share files.
- Saves happen in the step that computes a block (the worker side gathers every layer's slice of it
  after the forward pass), so nothing has to keep a finished request's blocks alive. The engine blocks
  a request holds are followed from the scheduler's outputs (vLLM 0.26 gives connectors no other way).
- A file block is checked before it is offered: the scheduler half reads each disk- or shared-tier
  block it would offer and verifies its checksum (turbine.kvbm.FileCheck; a file verified once is not
  read again while unchanged). A corrupt one is not offered (the match stops before it, or falls to
  a slower tier's good copy), its file is unlinked, and the worker half counts it
  (`turbine_kvbm_corrupt_blocks_total`) and drops it from its tier: those tokens are computed fresh.
  A load that fails is what vLLM 0.26 on a GPU does not survive (Model Runner V2 keeps a token
  sampled from the bad step, V1's engine died: docs/benchmarks/gpu.md), so the load must not meet a
  corrupt file; the check costs one more read of each file block offered (docs/benchmarks/kv_tiers.md,
  "The check before an offer").
- Loads are done (in stream order) when `start_load_kv` returns. A block that still cannot be read (a host
  block evicted, a file removed or changed since it was checked) is reported by
  `get_block_ids_with_load_errors`, and with `kv_load_failure_policy=recompute` the engine computes it
  instead: a bad block is never used, and blocks computed in a step that had a failed load are not saved.
- The two halves live in different processes (vLLM's CPU build always runs the model runner in a
  worker process of its own): the worker half owns the TieredStore and does all the I/O; the
  scheduler half decides hits from a mirror of which tier holds which block, fed each step by the
  worker's tier events (KVConnectorWorkerMetadata → update_connector_output). The mirror is exact as
  of the last step; a block evicted since is a failed load, hence recomputed, never a wrong one.
- The shared tier's blocks that other workers wrote are in no event of this worker's: past what its
  mirror knows, the scheduler half probes the shared directory (one stat per block, stopping at the
  first miss) and plans those blocks as loads too.
- The router's view: the scheduler half turns its mirror's changes into one consolidated stream
  (`take_events`, published by vLLM with the engine's own KV events; medium "turbine.kvbm/<tier>"):
  the worker's own tiers as one (stored on first appearance and when the fastest tier changes, removed
  when gone from all), the shared tier apart; turbine.vllm.kv_events_relay gives each event its tier.
  Tensor, pipeline and data parallelism are refused for now (one worker process per store).
- On a prefill worker it runs inside vLLM's MultiConnector beside NIXL (`--connector kvbm nixl`,
  turbine.vllm.connectors): the tiers onboard what the engine lost, NIXL sends the whole prompt's KV.
- The store's `turbine_kvbm_*` metrics reach the worker's /metrics by vLLM's connector-stats path
  (`get_kv_connector_stats` → SchedulerStats → `build_prom_metrics`): turbine.vllm.kvbm_stats.

A block's payload is its slice of every layer's cache in the logical layout the CPU and GPU attention
backends share, one format on every device; the copies between the engine's caches and the tiers
(synchronous on CPU; on a GPU gathered after the forward pass, copied to pinned host memory on a side
stream and stored by a writer thread, loaded by DMA before the forward pass) are turbine.vllm.kvbm_copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from turbine.kvbm import Block, DiskStore, FileCheck, HostStore, SharedStore, TieredStore, shared_tier_id
from turbine.kvbm.block import file_name
from turbine.kvbm.file_writer import ProcessFileWriter
from turbine.kvbm.files import file_identity, settled
from turbine.router.hashing import block_hashes
from turbine.vllm.compat import CacheHitSource
# kv_connector_extra_config's keys and the connector names: set by connectors.py from the --kv-* flags
from turbine.vllm.connectors import (
    DISK_BYTES,
    DISK_DIR,
    DISK_MIN_USES,
    HOST_BYTES,
    KVBM_CONNECTORS,
    SHARED_BYTES,
    SHARED_DIR,
)
from turbine.vllm.kvbm_copy import KvCacheBlocks
from turbine.vllm.kvbm_stats import KvbmPromMetrics, KvbmStats, StatsSource

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger("turbine.vllm.kvbm")


# Where a hit came from, for releases that ask (CacheHitSource's member names; None where the release has
# no CacheHitSource). vLLM has no source for a store other workers share: it counts as external_unspecified.
_SOURCES = {"host": "HOST", "disk": "DISK", "shared": "EXTERNAL_UNSPECIFIED"} if CacheHitSource is not None else None

TIER_ORDER = ("host", "disk", "shared")  # fastest first
FILE_READERS = min(8, os.cpu_count() or 1)  # threads reading one step's blocks from the file tiers
# Threads writing one step's blocks to the file tiers (on a GPU: the disk tier's, in the writer process): one fell
# behind a GPU's prefill. In the engine's process, 4 or 8 of them slowed its own thread (the GIL), hence the process
# (docs/benchmarks/gpu.md, eleventh session).
FILE_WRITERS = min(4, os.cpu_count() or 1)
# The writer process's threads: they share no GIL with the engine, and 4 fell behind a 16k-token prefill on an H200
# (12.2 of 16.6 GB written, docs/benchmarks/gpu.md, eleventh session).
PROCESS_FILE_WRITERS = min(8, os.cpu_count() or 1)
# Blocks a step loads per part: each part is read (into host slots) while the previous part's DMA runs, and its
# promotions into the host tier free older slots for the next part.
LOAD_PART = 64
UNSETTLED_MAX = 1 << 16  # written files whose identity is not yet sent to the scheduler half (oldest dropped)
PRIVATE_TIERS = ("host", "disk")  # this worker's own; the shared tier is everyone's who sees its directory
# vLLM's KV events name where a block lives by `medium` ("GPU" for the engine's cache): ours are
# "turbine.kvbm/<tier>", which turbine.vllm.kv_events_relay turns into the event's `tier`.
MEDIUM_PREFIX = "turbine.kvbm/"


def layout_key(vllm_config) -> str:
    """Names the KV layout a block payload has: model, dtype, block size, layers, heads."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = (mc.model, str(mc.dtype), str(cc.cache_dtype), cc.block_size, mc.get_num_layers(pc),
             mc.get_num_kv_heads(pc), mc.get_head_size())
    return f"{xxhash.xxh3_64_intdigest(repr(parts).encode()):016x}"


def disk_dir(vllm_config) -> str | None:
    """The disk tier's directory for this model's KV layout (None: no disk tier)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return os.path.join(extra[DISK_DIR], layout_key(vllm_config)) if extra.get(DISK_BYTES) else None


def shared_dir(vllm_config) -> str | None:
    """The shared tier's directory for this model's KV layout (None: no shared tier)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return os.path.join(extra[SHARED_DIR], layout_key(vllm_config)) if extra.get(SHARED_BYTES) else None


def kv_shared_tier(vllm_config) -> str | None:
    """The shared tier's id for the worker's card (turbine.kvbm.shared_tier_id), None without one."""
    kv = vllm_config.kv_transfer_config
    if kv is None:
        return None
    # Alone, or inside vLLM's MultiConnector (a prefill worker's `--connector kvbm nixl`).
    configs = kv.kv_connector_extra_config.get("connectors", []) if kv.kv_connector == "MultiConnector" else [
        {"kv_connector": kv.kv_connector, "kv_connector_extra_config": kv.kv_connector_extra_config}]
    for c in configs:
        extra = c.get("kv_connector_extra_config") or {}
        if c.get("kv_connector") in CONNECTOR_NAMES and extra.get(SHARED_BYTES):
            return shared_tier_id(extra[SHARED_DIR])
    return None


def build_store(vllm_config) -> TieredStore:
    """The worker half's tiers, from kv_connector_extra_config; each file tier in a directory per layout."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    tiers = []
    if extra.get(HOST_BYTES):
        tiers.append(HostStore(int(extra[HOST_BYTES])))
    if (disk := disk_dir(vllm_config)) is not None:
        tiers.append(DiskStore(disk, int(extra[DISK_BYTES])))
    if (shared := shared_dir(vllm_config)) is not None:
        # Not adopted: other workers' blocks there reach the scheduler half by its probe (see the module doc).
        tiers.append(SharedStore(shared, int(extra[SHARED_BYTES])))
    store = TieredStore(tiers, min_uses={"disk": int(extra[DISK_MIN_USES])} if extra.get(DISK_MIN_USES) else None)
    adopted = store.adopt_held()
    log.info("kvbm tiers: %s; %d blocks found on disk", ", ".join(f"{t.name} {t.capacity_bytes} bytes"
                                                                      for t in tiers), adopted)
    return store


@dataclass
class KvbmWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler each step: what the tiers gained and lost, (stored?, tier, block hash), and the
    identities of block files the worker wrote, (tier, block hash, file identity): known good without a check."""
    events: list[tuple[bool, str, int]] = field(default_factory=list)
    written: list[tuple[str, int, tuple[int, int, int, int]]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvbmWorkerMetadata)
        return KvbmWorkerMetadata(self.events + other.events, self.written + other.written)


@dataclass
class KvbmMetadata(KVConnectorMetadata):
    # (request id, engine block id, block hash) to read from the store into the engine before the forward pass
    loads: list[tuple[str, int, int]] = field(default_factory=list)
    # (request id, engine block id, block hash, parent hash or None) to copy out after the forward pass
    saves: list[tuple[str, int, int, int | None]] = field(default_factory=list)
    # (tier, block hash): file blocks the scheduler half found corrupt (and unlinked): the tier drops them
    corrupt: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request the scheduler side follows: its chain of block hashes so far."""
    request: Any
    lora_name: str | None
    hashes: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks already offloaded (or found in the store)
    block_ids: list[int] = field(default_factory=list)  # its engine blocks, from the scheduler's outputs


class TurbineKvbmConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.world_size != 1 or pc.data_parallel_size != 1:
            # The scheduler half mirrors the tiers of exactly one model-runner process.
            raise ValueError("--connector kvbm: one engine and one model-runner process per worker only (no "
                             "tensor, pipeline or data parallelism yet)")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(f"--connector kvbm: models with one KV cache group only (this one has {len(groups)})")
        self.block_size = vllm_config.cache_config.block_size
        mc = vllm_config.model_config
        self._kv_heads, self._head_size = mc.get_num_kv_heads(pc), mc.get_head_size()
        # scheduler side
        self._where: dict[int, set[str]] = {}  # the worker's tiers as of its last step: hash -> tiers
        self._tracked: dict[str, _Tracked] = {}
        self._lookups: dict[str, tuple[int, list[int], list[str]]] = {}  # req -> (first block, hashes, tiers)
        self._loads: list[tuple[str, int, int]] = []
        self._hit_sources: dict[str, dict[str, int]] = {}  # req -> {CacheHitSource name: tokens}
        # req -> {engine block id: block index} of the loads planned for this step / in the step running
        self._loading: dict[str, dict[int, int]] = {}
        self._in_flight: dict[str, dict[int, int]] = {}
        # The consolidated stream for the router, taken by vLLM's take_events: (stored?, tier, hash)
        self._events: list[tuple[bool, str, int]] = []
        # The file tiers' directories, whose blocks are checked before they are offered (but for those the worker
        # half wrote: it sends their identities); blocks other workers wrote to the shared one are in no event of
        # this worker's (probed).
        self._dirs = {tier: d for tier, d in (("disk", disk_dir(vllm_config)), ("shared", shared_dir(vllm_config)))
                      if d is not None}
        self._shared_dir = self._dirs.get("shared")
        self._file_check = FileCheck()
        self._corrupt: list[tuple[str, int]] = []  # found by the check, for the worker half's next step
        # worker side
        self.store = build_store(vllm_config) if role == KVConnectorRole.WORKER else None
        # What the disk tier held at start (an earlier run's files): reported with the first step's events, but
        # never remembered as written here (a crash may have left one short): the check reads them first.
        self._found_at_start = self.store.take_tier_events() if self.store is not None else []
        self._stats = StatsSource(self.store.metrics) if self.store is not None else None
        self._blocks: KvCacheBlocks | None = None
        self._readers: ThreadPoolExecutor | None = None  # file-tier reads of one step, in parallel
        self._writers: ThreadPoolExecutor | None = None  # file-tier writes of one step, in parallel
        self._file_writer: ProcessFileWriter | None = None  # on a GPU: the disk tier's writes, in a process
        self._unsettled: dict[tuple[str, int], None] = {}  # (tier, hash) of files written, identity not yet sent
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()

    # ============================ scheduler side ============================
    def on_new_request(self, request) -> None:
        # Prompt embeddings and multimodal inputs are not named by their token ids: not cached here.
        if request.prompt_embeds is not None or request.mm_features:
            return
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        self._tracked[request.request_id] = _Tracked(request, lora)

    def _hashes(self, t: _Tracked, num_blocks: int) -> list[int]:
        if len(t.hashes) < num_blocks:
            tokens = list(t.request.all_token_ids[len(t.hashes) * self.block_size:num_blocks * self.block_size])
            t.hashes.extend(block_hashes(tokens, self.block_size, lora_name=t.lora_name,
                                         parent=t.hashes[-1] if t.hashes else None))
        return t.hashes[:num_blocks]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        t = self._tracked.get(request.request_id)
        if t is None:
            return 0, False
        # Never the last token: the engine must compute one to sample from.
        loadable = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        if first >= loadable:
            return 0, False
        hashes = self._hashes(t, loadable)
        tiers = self._offerable(hashes[first:])
        if not tiers:
            self._lookups.pop(request.request_id, None)
            return 0, False
        self._lookups[request.request_id] = (first, hashes, tiers)
        return len(tiers) * self.block_size, False

    def _offerable(self, hashes: list[int]) -> list[str]:
        """For the longest leading run of `hashes` that can be offered, each block's tier (see _checked_tier).
        One block after another, in vLLM's scheduler loop: on the 2-core host it was measured on, checking
        several at a time on threads was slower, not faster (docs/benchmarks/kv_tiers.md, "The check before an
        offer")."""
        tiers: list[str] = []
        for h in hashes:
            where = self._where.get(h, ())
            candidates = [t for t in TIER_ORDER if t in where]
            # The shared tier also as the last resort; where the mirror knows no tier, probed first (one stat,
            # stopping at the first miss): another worker may have written it.
            if self._shared_dir is not None and "shared" not in where and (
                    candidates or os.path.exists(os.path.join(self._shared_dir, file_name(h)))):
                candidates.append("shared")
            if not candidates:
                break
            tier, corrupt = self._checked_tier(h, candidates)
            for bad in corrupt:  # unlinked: the mirror and the router forget it, the worker half drops and counts it
                self._corrupt.append((bad, h))
                self._mirror(False, bad, h)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def _checked_tier(self, block_hash: int, candidates: list[str]) -> tuple[str | None, list[str]]:
        """The first of `candidates` (tiers, fastest first) whose copy of the block can be offered, and those whose
        file was found corrupt (and unlinked) on the way: the host tier's copy as the mirror has it (in the
        worker's memory, nothing to read here), a file tier's once its file passes FileCheck. A file gone since
        the mirror's last step is passed over."""
        corrupt = []
        for tier in candidates:
            if tier not in self._dirs:
                return tier, corrupt
            status = self._file_check.check(os.path.join(self._dirs[tier], file_name(block_hash)), block_hash)
            if status == FileCheck.OK:
                return tier, corrupt
            if status == FileCheck.CORRUPT:
                corrupt.append(tier)
        return None, corrupt

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lookup is None:
            return
        first, hashes, tiers = lookup
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        self._loads.extend((request.request_id, block_ids[first + i], hashes[first + i]) for i in range(n))
        self._loading[request.request_id] = {block_ids[first + i]: first + i for i in range(n)}
        if _SOURCES is not None:  # kept only for a release that asks (get_external_cache_hit_sources)
            counts: dict[str, int] = {}
            for tier in tiers[:n]:
                source = _SOURCES.get(tier, "EXTERNAL_UNSPECIFIED")
                counts[source] = counts.get(source, 0) + self.block_size
            self._hit_sources[request.request_id] = counts

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """Asked by vLLM 0.32+ only (compat.CacheHitSource), which labels its cache-hit metrics with it."""
        counts = self._hit_sources.pop(request.request_id, None)
        if not num_external_tokens:
            return {}
        if counts is None or sum(counts.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource[name]: tokens for name, tokens in counts.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvbmMetadata:
        meta = KvbmMetadata(loads=self._loads, corrupt=self._corrupt)
        self._loads, self._corrupt = [], []
        self._in_flight, self._loading = self._loading, {}
        self._follow_block_ids(scheduler_output)
        planned: set[int] = set()  # two requests of one step may share a prefix
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(req_id)
            if t is None:
                continue
            # Full blocks whose KV exists once this step has run (the scheduler advances
            # num_computed_tokens after building this) and whose tokens are all known.
            done = min(t.request.num_computed_tokens + scheduled, len(t.request.all_token_ids)) // self.block_size
            if done <= t.saved:
                continue
            hashes = self._hashes(t, done)
            block_ids = t.block_ids
            loading = set(self._in_flight.get(req_id, {}).values())  # read from a tier this step: not saved
            for i in range(t.saved, done):
                if i not in loading and self._locate(hashes[i]) is None and hashes[i] not in planned:
                    planned.add(hashes[i])
                    meta.saves.append((req_id, block_ids[i], hashes[i], hashes[i - 1] if i else None))
            t.saved = done
        return meta

    def _follow_block_ids(self, scheduler_output: SchedulerOutput) -> None:
        """Each tracked request's engine blocks, as the scheduler hands them to the model runner (the same in
        every release this runs on; vLLM 0.26 has no kv-cache-manager handle for connectors)."""
        for new in scheduler_output.scheduled_new_reqs:
            if (t := self._tracked.get(new.req_id)) is not None:
                t.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if (t := self._tracked.get(req_id)) is None:
                continue
            if req_id in cached.resumed_req_ids:  # back from preemption: a new set of blocks
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids.extend(new_ids[0])

    def _locate(self, block_hash: int) -> str | None:
        where = self._where.get(block_hash)
        return next((t for t in TIER_ORDER if t in where), None) if where else None

    def update_connector_output(self, connector_output) -> None:
        if failed := connector_output.invalid_block_ids:
            # vLLM recomputes from the first block that failed to load: those blocks are to be saved again.
            for req_id, loaded in self._in_flight.items():
                bad = [i for block_id, i in loaded.items() if block_id in failed]
                if bad and (t := self._tracked.get(req_id)) is not None:
                    t.saved = min(t.saved, min(bad))
        self._in_flight = {}
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvbmWorkerMetadata):
            return
        for stored, tier, h in meta.events:
            self._mirror(stored, tier, h)
        for tier, h, identity in meta.written:
            if tier in self._dirs:  # the worker wrote it from the engine's KV: no need to read it before offering
                self._file_check.remember(os.path.join(self._dirs[tier], file_name(h)), tuple(identity))

    def _mirror(self, stored: bool, tier: str, h: int) -> None:
        """One tier gained (or lost) a block: the mirror, and the router's stream."""
        where = self._where.get(h) or set()
        before = _fastest_private(where), "shared" in where
        if stored:
            where.add(tier)
            self._where[h] = where
        elif tier in where:
            where.discard(tier)
            if not where:
                del self._where[h]
        after = _fastest_private(where), "shared" in where
        self._consolidate(h, before, after)

    def _consolidate(self, h: int, before: tuple[str | None, bool], after: tuple[str | None, bool]) -> None:
        """The router's stream: the worker's own tiers as one (stored when the block first appears in one
        of them and when its fastest one changes, removed when gone from all), the shared tier apart
        (every worker that sees it can load the block: the router counts it for them all)."""
        (private_before, shared_before), (private_after, shared_after) = before, after
        if private_after != private_before:
            self._events.append((private_after is not None, private_after or private_before, h))
        if shared_after != shared_before:
            self._events.append((shared_after, "shared", h))

    def take_events(self) -> list[KVCacheEvent]:
        """The consolidated stream, published by vLLM with the engine's own KV events (when they are on)
        and relayed to the router by turbine.vllm.kv_events_relay. Runs of one kind and tier become one
        event. Hashes are the router's own (the tiers name blocks by them); tokens are not sent."""
        out: list[KVCacheEvent] = []
        run: list[int] = []
        for i, (stored, tier, h) in enumerate(self._events):
            run.append(h)
            nxt = self._events[i + 1] if i + 1 < len(self._events) else None
            if nxt is not None and nxt[:2] == (stored, tier):
                continue
            medium = MEDIUM_PREFIX + tier
            if stored:
                out.append(BlockStored(block_hashes=run, parent_block_hash=None, token_ids=[],
                                       block_size=self.block_size, lora_id=None, medium=medium, lora_name=None))
            else:
                out.append(BlockRemoved(block_hashes=run, medium=medium))
            run = []
        self._events = []
        return out

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        return False, None  # saves are done in the step that computes a block: nothing to keep alive

    # ============================ worker side ============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        disk = next((t for t in self.store.tiers if isinstance(t, DiskStore)), None)
        self._blocks = KvCacheBlocks(kv_caches, num_blocks=self._kv_cache_config.num_blocks,
                                     num_kv_heads=self._kv_heads, block_size=self.block_size,
                                     head_size=self._head_size, store_blocks=self._store_blocks,
                                     host_tier_bytes=int(extra.get(HOST_BYTES) or 0),
                                     shared_slots=disk is not None)  # slots exist in background mode (a GPU) only
        for tier in self.store.tiers:
            if hasattr(tier, "read_buffer"):  # the file tiers read payloads straight into host slots (on a GPU)
                tier.read_buffer = self._blocks.read_buffer
        if self._blocks.background and self._blocks.slots.fd is not None:
            # The disk tier's files are written by a process of its own, from the slots (see file_writer.py).
            self._file_writer = ProcessFileWriter(self._blocks.slots.fd, self._blocks.slots.nbytes,
                                                  self._blocks.slots.offset_of, PROCESS_FILE_WRITERS)
            disk.write_files = self._file_writer.write

    def _store_blocks(self, blocks: list[tuple[int, int | None, memoryview]]) -> None:
        """Payloads (on a GPU: pinned host slots) into the tiers: the host tier keeps the payload itself, file
        tiers write it. On a GPU the disk tier's writer process writes a step's blocks together; elsewhere several
        blocks are put at a time on threads (the writes and their checksums run outside the GIL): one writer alone
        fell behind a GPU's prefill (docs/benchmarks/gpu.md)."""
        puts = [Block(block_hash, parent, self.block_size, data) for block_hash, parent, data in blocks]
        if self._file_writer is not None:
            self.store.put_many(puts)
            return
        if len(puts) < 2 or not self._dirs:
            for block in puts:
                self.store.put(block)
            return
        if self._writers is None:
            self._writers = ThreadPoolExecutor(FILE_WRITERS, thread_name_prefix="kvbm-write")
        list(self._writers.map(self.store.put, puts))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbmMetadata)
        self._failed_reqs = set()
        for tier, block_hash in meta.corrupt:
            self.store.drop_corrupt(tier, block_hash)
        self._blocks.begin_loads()
        if not meta.loads:
            return
        began = time.perf_counter()
        # In parts: one part's copies to the GPU run (asynchronously, from host slots) while the next is read.
        for start in range(0, len(meta.loads), LOAD_PART):
            self._load_part(meta.loads[start:start + LOAD_PART])
        self.store.metrics.step_load_seconds.inc(time.perf_counter() - began)

    def _load_part(self, part: list[tuple[str, int, int]]) -> None:
        loads = []
        # The scheduler half checked every file block offered here; this check stays as the second guard: a
        # file can still change between that check and this read (another worker rewrites a shared block, a
        # disk fails), and then the block is reported as a load error and vLLM recomputes it (which vLLM
        # 0.32's V1 runner survives and 0.26's on a GPU does not: the window is one step).
        fetched = self._fetch([block_hash for _, _, block_hash in part])
        for (req_id, block_id, block_hash), found in zip(part, fetched):
            if req_id in self._failed_reqs:
                self._load_errors.add(block_id)  # after a failed block the rest of the prefix is recomputed
                self.store.metrics.load_errors.inc()
                continue
            if found is None or found[0].nbytes != self._blocks.block_nbytes:
                why = "gone or corrupt" if found is None else \
                    f"{found[0].nbytes} bytes, not {self._blocks.block_nbytes}"
                log.warning("kvbm: block %016x unavailable (%s): recomputed", block_hash, why)
                self._load_errors.add(block_id)
                self.store.metrics.load_errors.inc()
                self._failed_reqs.add(req_id)
                continue
            loads.append((block_id, found[0].data))
        self._blocks.load(loads)

    def _fetch(self, hashes: list[int]) -> list[tuple[Block, str] | None]:
        """The tiers' copies of `hashes`, in order; when several come from files, read several at a time (see
        TieredStore.get_many: the tiers' recency stays as with one read at a time)."""
        from_files = sum(self.store.locate(h) not in (None, "host") for h in hashes)
        if from_files < 2:
            return self.store.get_many(hashes)
        if self._readers is None:
            self._readers = ThreadPoolExecutor(FILE_READERS, thread_name_prefix="kvbm-read")
        return self.store.get_many(hashes, self._readers.map)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are complete (in stream order) when start_load_kv returns

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are copied out in wait_for_save, after every layer has run

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbmMetadata)
        # A step that attended over a block that failed to load keeps none of its output.
        saves = [(block_id, block_hash, parent) for req_id, block_id, block_hash, parent in meta.saves
                 if req_id not in self._failed_reqs]
        if not saves:
            return
        began = time.perf_counter()
        self._blocks.save(saves)
        self.store.metrics.step_save_seconds.inc(time.perf_counter() - began)

    def shutdown(self) -> None:
        if self._blocks is not None:
            self._blocks.close()
        if self._readers is not None:
            self._readers.shutdown(wait=False)
        if self._writers is not None:
            self._writers.shutdown(wait=False)
        if self._file_writer is not None:
            self._file_writer.close()

    def build_connector_worker_meta(self) -> KvbmWorkerMetadata | None:
        events = self.store.take_tier_events()
        found, self._found_at_start = self._found_at_start, []
        # The scheduler half builds the router's stream (take_events) from its mirror of these tier
        # events, so the store's own consolidated stream is only kept from growing here.
        self.store.take_events()
        written = self._settled_files(events)
        events = found + events
        if not events and not written:
            return None
        return KvbmWorkerMetadata([(e.kind == "stored", e.tier, e.block_hash) for e in events], written)

    def _settled_files(self, events) -> list[tuple[str, int, tuple[int, int, int, int]]]:
        """The identities of the files this worker wrote, each once it has settled (FileCheck: its mtime past the
        clock's tick), so that the scheduler half offers them without reading them first."""
        for e in events:
            if e.kind == "stored" and e.tier in self._dirs:
                self._unsettled[(e.tier, e.block_hash)] = None
        while len(self._unsettled) > UNSETTLED_MAX:
            del self._unsettled[next(iter(self._unsettled))]
        out = []
        for key in list(self._unsettled):
            tier, h = key
            identity = file_identity(os.path.join(self._dirs[tier], file_name(h)))
            if identity is None or settled(identity):
                del self._unsettled[key]
                if identity is not None:
                    out.append((tier, h, identity))
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # ======== metrics: worker half -> engine core -> the Turbine worker's /metrics (kvbm_stats) ========
    def get_kv_connector_stats(self) -> KvbmStats | None:
        return self._stats.take() if self._stats is not None else None  # the scheduler half counts nothing

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvbmStats:
        return KvbmStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvbmPromMetrics:
        return KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class TurbineKvbmPdConnector(TurbineKvbmConnector, SupportsHMA):
    """The same connector for a prefill worker's `--connector kvbm nixl`, declared fit for vLLM's hybrid KV
    cache manager (HMA). NIXL's handshake refuses a peer whose HMA setting differs (it is in NIXL's
    compatibility hash), a decode worker (NIXL alone) runs with HMA on, and MultiConnector turns HMA off
    when a child lacks it: every hand-off failed that way. With one KV cache group, the only kind this
    connector takes, HMA changes nothing here. Alone (aggregated) the connector keeps HMA off, so that a
    sliding-window model stays one group for it."""

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])


CONNECTOR_NAMES = KVBM_CONNECTORS

# Inside vLLM's MultiConnector (`--connector kvbm nixl`) the stats of each step reach the worker process
# keyed by class name, and vLLM's periodic log line rebuilds them with the class it finds under that
# name in its registry: registered here, which that process imports (turbine.vllm.worker).
for _name in CONNECTOR_NAMES:
    with contextlib.suppress(ValueError):  # "already registered"
        KVConnectorFactory.register_connector(_name, __name__, _name)


def _fastest_private(where: set[str]) -> str | None:
    return next((t for t in PRIVATE_TIERS if t in where), None)

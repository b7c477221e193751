"""--connector → vLLM's KV transfer config, and the NIXL side channel of this worker.

A disaggregated worker moves KV through one of vLLM's own KV connectors; Turbine only
chooses and configures it. Several connectors become vLLM's MultiConnector, tried in the
order given (the first that holds a block serves it).

`kvbm` (Turbine's KV tiers) combines with `nixl` on a prefill worker, in either order, as
Dynamo's PdConnector combines KVBM with NIXL there: vLLM's MultiConnector asks every connector
for a prompt's external blocks and gives the request to the first that has some, and on a
prefill worker NIXL never has any (it only sends, after the prefill), so the tiers onboard what
the engine lost and NIXL hands the whole prompt's KV (onboarded blocks included) to the decode
worker. Not on a decode worker: there, first in order, a tier hit would win the request over
NIXL's pull and the rest of the prompt would be computed on the decode side; second, it would
never serve a request (NIXL claims every remote-prefilled prompt) and only copy blocks out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from turbine.flag_sources import env_int
from turbine.runtime.ports import claim_port_run

CONNECTORS = ("nixl", "lmcache", "kvbm", "offload", "none")

# LMCache on the vLLM CPU build (read from lmcache 0.5.6, PyPI's latest; see docs/benchmarks/kv_tiers.md).
LMCACHE_CPU_REFUSED = (
    "--connector lmcache cannot run on the vLLM CPU build: LMCache (0.5.6) moves KV between the engine and its "
    "cache through a per-device connector and has none for vLLM on the CPU (lmcache/v1/gpu_connector: \"No "
    "supported cpu connector found\"); its package also requires CUDA ones (cupy-cuda13x, cuda-python) and its "
    "cuda_ops links libcudart. Use --connector kvbm with --kv-host-cache-gb / --kv-disk-cache-gb")

# vLLM's own CPU offloading (OffloadingConnector): named so that asking for it gets the reason, not "unknown".
OFFLOAD_REFUSED = (
    "--connector offload (vLLM's OffloadingConnector) is refused: it cannot run on the vLLM CPU build (its CPU "
    "offloading spec copies between a CUDA or XPU device's KV cache and host memory; vllm/v1/kv_offload/cpu/spec.py "
    "refuses other platforms: \"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs\"), and "
    "Turbine has not run it on a GPU (there, vLLM's own --kv-transfer-config reaches it). Use --connector kvbm "
    "with --kv-host-cache-gb / --kv-disk-cache-gb")


class ConnectorError(ValueError):
    """A --connector choice that cannot be served here (the message names the flag)."""


@dataclass(frozen=True)
class KvbmTiers:
    """--kv-host-cache-gb, --kv-disk-cache-gb, --kv-disk-cache-dir (GiB: 2**30 bytes), --kv-disk-min-uses,
    --kv-shared-cache-gb, --kv-shared-cache-dir."""
    host_gb: float | None = None
    disk_gb: float | None = None
    disk_dir: str | None = None
    disk_min_uses: int | None = None  # the disk tier's frequency filter (None: every block is written)
    shared_gb: float | None = None
    shared_dir: str | None = None


GIB = 1 << 30


def check_kvbm_flags(names: list[str], tiers: KvbmTiers) -> None:
    """The tier flags are only for --connector kvbm, and each needs its partner."""
    given = [f for f, v in (("--kv-host-cache-gb", tiers.host_gb), ("--kv-disk-cache-gb", tiers.disk_gb),
                            ("--kv-disk-cache-dir", tiers.disk_dir), ("--kv-disk-min-uses", tiers.disk_min_uses),
                            ("--kv-shared-cache-gb", tiers.shared_gb), ("--kv-shared-cache-dir", tiers.shared_dir))
             if v is not None]
    if given and "kvbm" not in names:
        raise ConnectorError(f"{', '.join(given)}: the KV tiers need --connector kvbm")
    if "kvbm" not in names:
        return
    if others := [n for n in names if n not in ("kvbm", "nixl")]:
        raise ConnectorError(f"--connector kvbm combines with nixl only (on a prefill worker), not with "
                             f"{', '.join(others)}")
    for flag_name, value in (("--kv-host-cache-gb", tiers.host_gb), ("--kv-disk-cache-gb", tiers.disk_gb),
                             ("--kv-shared-cache-gb", tiers.shared_gb)):
        if value is not None and not value > 0:
            raise ConnectorError(f"{flag_name} must be > 0, got {value}")
    if (tiers.disk_gb is None) != (tiers.disk_dir is None):
        raise ConnectorError("--kv-disk-cache-gb and --kv-disk-cache-dir go together (the disk tier's size and "
                             "directory)")
    if tiers.disk_min_uses is not None:
        if tiers.disk_gb is None:
            raise ConnectorError("--kv-disk-min-uses filters the disk tier: it needs --kv-disk-cache-gb and "
                                 "--kv-disk-cache-dir")
        if tiers.disk_min_uses < 1:
            raise ConnectorError(f"--kv-disk-min-uses must be >= 1, got {tiers.disk_min_uses}")
    if (tiers.shared_gb is None) != (tiers.shared_dir is None):
        raise ConnectorError("--kv-shared-cache-gb and --kv-shared-cache-dir go together (the shared tier's size "
                             "and directory)")
    if tiers.disk_dir is not None and tiers.shared_dir is not None and (
            os.path.abspath(tiers.disk_dir) == os.path.abspath(tiers.shared_dir)):
        raise ConnectorError("--kv-disk-cache-dir and --kv-shared-cache-dir must differ (the disk tier is this "
                             "worker's alone, the shared one everyone's)")
    if tiers.host_gb is None and tiers.disk_gb is None and tiers.shared_gb is None:
        raise ConnectorError("--connector kvbm needs a tier: --kv-host-cache-gb, --kv-disk-cache-gb with "
                             "--kv-disk-cache-dir and/or --kv-shared-cache-gb with --kv-shared-cache-dir")


# kv_connector_extra_config's keys, read by turbine.vllm.kvbm_connector (which vLLM imports in the engine)
HOST_BYTES, DISK_BYTES, DISK_DIR, DISK_MIN_USES = "host_bytes", "disk_bytes", "disk_dir", "disk_min_uses"
SHARED_BYTES, SHARED_DIR = "shared_bytes", "shared_dir"


def kvbm_config(tiers: KvbmTiers, with_nixl: bool = False) -> dict:
    extra = {}
    if tiers.host_gb is not None:
        extra[HOST_BYTES] = int(tiers.host_gb * GIB)
    if tiers.disk_gb is not None:
        extra[DISK_BYTES] = int(tiers.disk_gb * GIB)
        extra[DISK_DIR] = os.path.abspath(tiers.disk_dir)
    if tiers.disk_min_uses is not None:
        extra[DISK_MIN_USES] = tiers.disk_min_uses
    if tiers.shared_gb is not None:
        extra[SHARED_BYTES] = int(tiers.shared_gb * GIB)
        extra[SHARED_DIR] = os.path.abspath(tiers.shared_dir)
    # A block that cannot be read back (evicted meanwhile, a corrupt file) is computed instead.
    # Beside nixl: the variant that keeps vLLM's hybrid KV cache manager on, as on the decode worker
    # (NIXL's handshake needs both sides alike; see TurbineKvbmPdConnector).
    name = "TurbineKvbmPdConnector" if with_nixl else "TurbineKvbmConnector"
    return {"kv_connector": name, "kv_connector_module_path": "turbine.vllm.kvbm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _single(name: str, buffer_device: str, tiers: KvbmTiers | None = None, with_nixl: bool = False) -> dict:
    if name == "nixl":
        # The KV buffer lives where the engine's cache does: host memory on the CPU platform.
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": buffer_device}
        if buffer_device == "cpu":
            cfg["kv_connector_module_path"] = "turbine.vllm.nixl_cpu"  # no busy progress thread
        return cfg
    if name == "lmcache":
        if buffer_device == "cpu":
            raise ConnectorError(LMCACHE_CPU_REFUSED)
        try:
            import lmcache  # noqa: F401
        except ImportError:
            raise ConnectorError("--connector lmcache: the lmcache package is not installed "
                                 "(pip install lmcache)") from None
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if name == "kvbm":
        return kvbm_config(tiers or KvbmTiers(), with_nixl)
    if name == "offload":
        raise ConnectorError(OFFLOAD_REFUSED)
    raise ConnectorError(f"--connector {name!r}: choose from {', '.join(CONNECTORS)}")


def parse_connectors(value: str | None) -> list[str]:
    """'nixl,lmcache' or 'nixl lmcache' → ['nixl', 'lmcache']; 'none' alone means no connector."""
    if value is None:
        return []
    names = [n for n in value.replace(",", " ").split() if n]
    bad = [n for n in names if n not in CONNECTORS]
    if bad or not names:
        raise ConnectorError(f"--connector {value!r}: choose one or more of {', '.join(CONNECTORS)}")
    if "none" in names:
        if len(names) > 1:
            raise ConnectorError("--connector none cannot be combined with other connectors")
        return []
    if len(set(names)) != len(names):
        raise ConnectorError(f"--connector {value!r}: a connector is named twice")
    return names


def kv_transfer_config(names: list[str], *, buffer_device: str, decode: bool,
                       tiers: KvbmTiers | None = None) -> dict | None:
    """vLLM's KVTransferConfig fields for these connectors (None: no connector)."""
    check_kvbm_flags(names, tiers or KvbmTiers())
    if not names:
        return None
    parts = [_single(n, buffer_device, tiers, with_nixl="nixl" in names) for n in names]
    cfg = parts[0] if len(parts) == 1 else {
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": parts}}
    if decode or "kvbm" in names:
        # KV that cannot be pulled (prefill worker gone) is computed here instead of failing
        # the request: the decode worker always holds the whole prompt. Likewise a tier's block
        # that cannot be read back (vLLM reads the policy from the top-level config only).
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def _uses(cfg, names: tuple[str, ...]) -> bool:
    """Whether vLLM's KV transfer config (object or None) includes one of the connectors `names`."""
    if cfg is None:
        return False
    if cfg.kv_connector in names:
        return True
    if cfg.kv_connector == "MultiConnector":
        return any(c.get("kv_connector") in names for c in cfg.kv_connector_extra_config.get("connectors", []))
    return False


def uses_nixl(cfg) -> bool:
    return _uses(cfg, ("NixlConnector",))


KVBM_CONNECTORS = ("TurbineKvbmConnector", "TurbineKvbmPdConnector")  # turbine.vllm.kvbm_connector's


def uses_kvbm(cfg) -> bool:
    return _uses(cfg, KVBM_CONNECTORS)


# The KV tiers load blocks synchronously (in the step that needs them), and a block that fails to load is
# recomputed: the scheduler rewinds the request, and so must the model runner's own copy of its tokens. vLLM's
# Model Runner V1 does (gpu_model_runner.py: "discarded due to a sync-KV-load failure"); Model Runner V2, the GPU
# default for most generate models from 0.26 to at least 0.33, keeps the token sampled in the failed step, and
# the answer comes out wrong (seen on an H200 with vLLM 0.26: issue #29). The CPU build runs V1 only.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def kvbm_runner_refusal() -> str | None:
    """Why --connector kvbm cannot run with this environment's model runner (None: it can)."""
    if os.environ.get(V2_RUNNER_ENV, "").strip() not in ("", "0"):
        return (f"--connector kvbm with {V2_RUNNER_ENV}={os.environ[V2_RUNNER_ENV]}: vLLM's Model Runner V2 does not "
                "rewind a request whose KV-tier block failed to load, so the answer would be wrong; unset it (the "
                "tiers run the V1 runner)")
    return None


def keep_model_runner_v1() -> None:
    """For --connector kvbm: vLLM's V1 model runner, unless the environment chose one (kvbm_runner_refusal)."""
    os.environ.setdefault(V2_RUNNER_ENV, "0")


def claim_nixl_side_channel(host: str, data_parallel_size: int = 1) -> int:
    """Picks this worker's NIXL side-channel port (vLLM's default, 5600, is the same for every
    worker, so two on one host collide) and exports it, with the host, for the engine.
    The user's VLLM_NIXL_SIDE_CHANNEL_PORT wins. Each data-parallel rank uses port + rank."""
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", host)
    if (given := env_int("VLLM_NIXL_SIDE_CHANNEL_PORT", None)) is not None:
        return given
    # The engine binds it tens of seconds from now: claimed (locked for this process), not just found free.
    try:
        port = claim_port_run(host, data_parallel_size, "the NIXL side channel")
    except RuntimeError as exc:
        raise ConnectorError(str(exc)) from None
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    return port



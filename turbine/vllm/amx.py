"""Intel AMX's tile state after a CRIU restore (checkpoint mode on a CPU).

Linux gives a process AMX's tile data (XTILEDATA) only once the process asks for it (arch_prctl
ARCH_REQ_XCOMP_PERM). CRIU (4.2.1) restores a process without that permission, while oneDNN and vLLM's CPU
kernels in it remember having asked: the first tile instruction after the restore raises SIGILL. On this project's
CPU host with AMX, a restored worker's model runner died at its first step with exit code -4; a plain process that
asks again after its restore runs on (2026-11-30). So after a restore every process of the engine that computes
asks again: the worker's own, and vLLM's model runners through `collective_rpc` and the worker extension below.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache
from pathlib import Path

from turbine.vllm.sleep import platform_sleep_refusal

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

# vLLM's --worker-extension-cls: its methods join each model-runner process's worker, for collective_rpc.
EXTENSION = "turbine.vllm.amx.RestoredTiles"
RPC = "turbine_request_amx_tiles"


@cache
def has_amx() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in lines)


def needed_after_restore() -> bool:
    """Whether a restored engine must ask for the tile state again: vLLM on this CPU (no GPU platform) with AMX."""
    return platform_sleep_refusal() is not None and has_amx()


def request_tiles() -> bool:
    """Ask (again) for the tile state for this process; True when granted, False without AMX."""
    if not has_amx():
        return False
    return ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


class RestoredTiles:
    """Mixed into vLLM's worker class by `--worker-extension-cls` (checkpoint mode on a CPU with AMX)."""

    def turbine_request_amx_tiles(self) -> bool:
        return request_tiles()

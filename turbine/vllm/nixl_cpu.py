"""vLLM's own NixlConnector, for CPU hosts, with two fixes for sharing a host's cores.

1. NIXL's progress thread off. NIXL's agent starts a progress thread by default that polls without sleeping: a whole core
per worker, idle or not. On a GPU host that core is spare; on a CPU host it is the engine's
(two workers on two cores ran 10x slower). Without the thread, the transfers still progress:
vLLM polls transfer state and notifications from its engine steps.

2. The engine's core binding kept. On CPU, vLLM's NIXL worker moves the calling thread onto
the last core of each NUMA node (meant to keep KV transfers off the compute cores), but the
calling thread is the one that runs the model. So every prefill and decode worker on a host
computed on the same core, whatever VLLM_CPU_OMP_THREADS_BIND said: on 2 cores a 1P1D pair
under load ran minutes per request and the prefill worker timed out. The binding that thread
had before the connector was made is put back.

vLLM imports the connector class from here (kv_connector_module_path) in its worker process,
so importing this module is what turns the thread off there. The class keeps vLLM's name,
"NixlConnector", because vLLM recognizes the connector by that name in its config checks.
"""

from __future__ import annotations

import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as _VllmNixlConnector

__all__ = ["NixlConnector"]

_agent_config = base_worker.nixl_agent_config


def _agent_config_without_progress_thread(*args, **kwargs):
    kwargs.setdefault("enable_prog_thread", False)
    return _agent_config(*args, **kwargs)


if _agent_config is not None and not hasattr(_agent_config, "turbine_patched"):
    _agent_config_without_progress_thread.turbine_patched = True
    base_worker.nixl_agent_config = _agent_config_without_progress_thread


class NixlConnector(_VllmNixlConnector):
    def __init__(self, *args, **kwargs):
        cores = os.sched_getaffinity(0)  # this thread's (pid 0 = the calling thread)
        try:
            super().__init__(*args, **kwargs)
        finally:
            if os.sched_getaffinity(0) != cores:
                os.sched_setaffinity(0, cores)

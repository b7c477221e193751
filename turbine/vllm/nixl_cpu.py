"""vLLM's own NixlConnector, for CPU hosts: the same connector with NIXL's progress thread off.

NIXL's agent starts a progress thread by default that polls without sleeping: a whole core
per worker, idle or not. On a GPU host that core is spare; on a CPU host it is the engine's
(two workers on two cores ran 10x slower). Without the thread, the transfers still progress:
vLLM polls transfer state and notifications from its engine steps.

vLLM imports the connector class from here (kv_connector_module_path) in its worker process,
so importing this module is what turns the thread off there. The class keeps vLLM's name,
"NixlConnector", because vLLM recognizes the connector by that name in its config checks.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]

_agent_config = base_worker.nixl_agent_config


def _agent_config_without_progress_thread(*args, **kwargs):
    kwargs.setdefault("enable_prog_thread", False)
    return _agent_config(*args, **kwargs)


if _agent_config is not None and not hasattr(_agent_config, "turbine_patched"):
    _agent_config_without_progress_thread.turbine_patched = True
    base_worker.nixl_agent_config = _agent_config_without_progress_thread

"""LoRA adapters on the vLLM engine: the worker host's `LoraEngine` (turbine/worker/lora.py runs
the load / unload sequence and checks the adapter first). Adapters go in and out at run time
through the engine's own `add_lora` / `remove_lora` (vLLM's runtime LoRA updating; the engine
needs --enable-lora, with --max-loras adapters in a batch, --max-lora-rank and --max-cpu-loras
kept in host memory). A request naming a loaded adapter is generated with its LoRARequest."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from vllm.lora.request import LoRARequest

from turbine.runtime.errors import AdapterNotLoaded, InvalidRequest
from turbine.worker.lora_check import AdapterError

log = logging.getLogger("turbine.vllm")

NO_LORA = "this worker takes no LoRA adapters: start it with --enable-lora"
# An unload waits this long for the requests still generating with the adapter, then removes it
# anyway (vLLM would load it again from its folder for them).
UNLOAD_DRAIN_S = 30.0


class VllmLora:
    def __init__(self, engine, model_path: str, served_model_name: str):
        self.engine = engine
        self.lora_config = engine.vllm_config.lora_config  # None without --enable-lora
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.requests: dict[str, LoRARequest] = {}  # the adapters requests may name
        self.in_use: dict[str, int] = {}  # adapter name -> requests generating with it now

    def lora_refusal(self) -> str | None:
        return None if self.lora_config is not None else NO_LORA

    @property
    def max_lora_rank(self) -> int | None:
        return self.lora_config.max_lora_rank if self.lora_config is not None else None

    @property
    def base_model_dir(self) -> str | None:
        return self.model_path if os.path.isdir(self.model_path) else None

    async def add(self, name: str, lora_id: int, path: str) -> None:
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path,
                              base_model_name=self.served_model_name)
        if not await self.engine.add_lora(request):
            raise AdapterError(f"the engine did not add adapter {name!r}")
        self.requests[name] = request

    async def remove(self, name: str, lora_id: int) -> None:
        """New requests naming it are refused at once; the engine removes it once the requests
        generating with it ended (or UNLOAD_DRAIN_S passed)."""
        request = self.requests.pop(name, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNLOAD_DRAIN_S
        while self.in_use.get(name) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_use.get(name):
            log.warning("adapter %r: %d request(s) still use it after %.0f s; removing it anyway", name,
                        self.in_use[name], UNLOAD_DRAIN_S)
        try:
            await self.engine.remove_lora(lora_id)
        except BaseException:
            if request is not None:
                self.requests[name] = request  # still loaded: served again
            raise

    def hold(self, name: str) -> Callable[[], None]:
        """A request generates with the adapter from now on; call the result when it ends."""
        self.in_use[name] = self.in_use.get(name, 0) + 1

        def release() -> None:
            left = self.in_use[name] - 1
            if left:
                self.in_use[name] = left
            else:
                del self.in_use[name]
        return release

    def request(self, name: str | None) -> LoRARequest | None:
        """The engine's LoRARequest of a request's `lora_name` (None: the base model); InvalidRequest
        when no such adapter is loaded here."""
        if name is None:
            return None
        if self.lora_config is None:
            raise InvalidRequest(f"lora_name {name!r}: {NO_LORA}", param="lora_name")
        request = self.requests.get(name)
        if request is None:
            raise AdapterNotLoaded(name)
        return request

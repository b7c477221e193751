"""Sleep / wake of the vLLM engine: the only code that puts an AsyncLLM to sleep or wakes it
(the worker host's sleep sequence, turbine/worker/sleep.py, calls it once the instance is out
of discovery and drained; a GPU benchmark can call `sleep_engine` / `wake_engine` directly).

vLLM sleeps only where its platform has a sleep mode (CUDA, ROCm, XPU) and the engine was
started with --enable-sleep-mode. vLLM's CPU build has none: its platform refuses
--enable-sleep-mode ("Sleep mode is not supported on current platform."), and without the flag
AsyncLLM.sleep() would pause the scheduler and clear the prefix cache while CPUWorker.sleep()
only logs "sleep mode is not supported on CPU, ignore it." and frees nothing. So on CPU sleep is
refused (`sleep_refusal`), never accepted and left inert."""

from __future__ import annotations

import time

NO_SLEEP_MODE_PLATFORM = ("vLLM's {platform} platform has no sleep mode (vLLM sleeps on CUDA, ROCm and XPU only; "
                          "on CPU --enable-sleep-mode is refused and CPUWorker.sleep() frees nothing)")
NO_SLEEP_MODE_FLAG = "the engine was started without --enable-sleep-mode"


def platform_sleep_refusal() -> str | None:
    """Why no engine can sleep on this machine's vLLM platform, or None."""
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return None
    return NO_SLEEP_MODE_PLATFORM.format(platform=current_platform.device_type)


NO_WEIGHTS_TO_RELOAD = ("level 2 discards the weights and this engine has none to load again (--load-format {fmt}); "
                        "use level 1")


def sleep_refusal(engine, level: int = 1) -> str | None:
    """Why this AsyncLLM cannot sleep at `level`, or None if it can."""
    if reason := platform_sleep_refusal():
        return reason
    if not engine.vllm_config.model_config.enable_sleep_mode:
        return NO_SLEEP_MODE_FLAG
    load_format = str(engine.vllm_config.load_config.load_format)
    if level == 2 and load_format == "dummy":  # reload_weights raises NotImplementedError on dummy weights
        return NO_WEIGHTS_TO_RELOAD.format(fmt=load_format)
    return None


async def sleep_engine(engine, level: int) -> None:
    """Level 1: the KV cache is discarded (weights offloaded to host memory); level 2: the
    weights are discarded too. Requests still in the engine are aborted (the caller drained
    them first); the scheduler stays paused until `wake_engine`."""
    await engine.sleep(level, mode="abort")


async def wake_engine(engine, reload_weights: bool = False) -> None:
    """Everything sleep freed is back and the scheduler runs again. After a level-2 sleep pass
    `reload_weights`: vLLM's wake_up gives the weights their memory back but not their values
    (measured on an H100: greedy output 0 % equal, the one-token canary still passing), so
    they are loaded again from the model's files before anything is generated."""
    await engine.wake_up(tags=None)
    if reload_weights:
        await engine.collective_rpc("reload_weights")
    if await engine.is_paused():  # wake_up resumes it when fully awake; make sure
        await engine.resume_generation()


class VllmSleep:
    """The engine's sleep as the worker host uses it (turbine/worker/sleep.py's EngineSleep)."""

    def __init__(self, engine, on_change=None, on_reload=None):
        self.engine = engine
        self.on_change = on_change  # told the sleep level (0: awake), e.g. for the KV gauge
        self.on_reload = on_reload  # told the seconds a wake from level 2 took (the weights loaded again)
        self.level = 0

    def sleep_refusal(self, level: int = 1) -> str | None:
        reason = sleep_refusal(self.engine, level)
        return None if reason is None else f"this vLLM worker cannot sleep: {reason}"

    async def sleep(self, level: int) -> None:
        await sleep_engine(self.engine, level)
        self.level = level
        if self.on_change is not None:
            self.on_change(level)

    async def wake_up(self) -> None:
        waking = time.monotonic()
        await wake_engine(self.engine, reload_weights=self.level == 2)
        if self.level == 2 and self.on_reload is not None:
            self.on_reload(time.monotonic() - waking)
        self.level = 0
        if self.on_change is not None:
            self.on_change(0)

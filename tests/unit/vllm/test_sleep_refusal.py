"""vLLM's CPU build cannot sleep: the worker refuses sleep (and checkpoint mode, which needs it)
with a message naming why, before anything changes. No engine is started here."""

import asyncio

import pytest

from turbine.vllm.args import parse_worker_args
from turbine.vllm.sleep import VllmSleep, platform_sleep_refusal
from turbine.vllm.worker import VllmEngine
from turbine.worker.host import EXIT_BAD_CONFIG, WorkerHost


def test_the_cpu_platform_has_no_sleep_mode():
    reason = platform_sleep_refusal()
    assert reason is not None and "cpu platform has no sleep mode" in reason


def test_enable_sleep_mode_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(["--enable-sleep-mode"])
    assert info.value.code == 2
    assert "--enable-sleep-mode: vLLM's cpu platform has no sleep mode" in capsys.readouterr().err


def test_the_engines_sleep_refuses_before_touching_the_engine():
    sleep = VllmSleep(engine=None)  # never reached: the platform check comes first
    assert sleep.sleep_refusal(1).startswith("this vLLM worker cannot sleep: vLLM's cpu platform")


def test_checkpoint_mode_is_refused_before_the_engine_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_SNAPSHOT_CONTROL_DIR", str(tmp_path))
    cfg = parse_worker_args(["--enforce-eager"])
    engine = VllmEngine(cfg)
    assert "cannot be checkpointed: vLLM's cpu platform has no sleep mode" in engine.checkpoint_refusal()
    assert asyncio.run(WorkerHost(cfg, engine).run()) == EXIT_BAD_CONFIG
    assert engine.engine is None and list(tmp_path.iterdir()) == []


class RecordingAsyncLLM:
    """Stands in for AsyncLLM on a platform with a sleep mode (none here): notes each call."""

    def __init__(self, load_format="auto"):
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True),
                                           load_config=SimpleNamespace(load_format=load_format))
        self.calls = []

    async def sleep(self, level, mode):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags):
        self.calls.append(("wake_up",))

    async def collective_rpc(self, method):
        self.calls.append(("rpc", method))

    async def is_paused(self):
        return False


def test_waking_from_level_2_loads_the_weights_again(monkeypatch):
    # On a GPU, vLLM's wake_up after level 2 gives the weights memory but not values (the H100 run in
    # docs/benchmarks/gpu.md): the worker must load them again before it serves.
    monkeypatch.setattr("turbine.vllm.sleep.platform_sleep_refusal", lambda: None)
    engine = RecordingAsyncLLM()
    sleep = VllmSleep(engine)

    async def cycle(level):
        assert sleep.sleep_refusal(level) is None
        await sleep.sleep(level)
        await sleep.wake_up()

    asyncio.run(cycle(1))
    assert engine.calls == [("sleep", 1), ("wake_up",)]
    engine.calls.clear()
    asyncio.run(cycle(2))
    assert engine.calls == [("sleep", 2), ("wake_up",), ("rpc", "reload_weights")]


def test_level_2_is_refused_when_there_are_no_weights_to_load_again(monkeypatch):
    monkeypatch.setattr("turbine.vllm.sleep.platform_sleep_refusal", lambda: None)
    sleep = VllmSleep(RecordingAsyncLLM(load_format="dummy"))
    assert sleep.sleep_refusal(1) is None
    assert "--load-format dummy" in sleep.sleep_refusal(2)

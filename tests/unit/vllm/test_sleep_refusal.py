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
    assert sleep.sleep_refusal().startswith("this vLLM worker cannot sleep: vLLM's cpu platform")


def test_checkpoint_mode_is_refused_before_the_engine_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_SNAPSHOT_CONTROL_DIR", str(tmp_path))
    cfg = parse_worker_args(["--enforce-eager"])
    engine = VllmEngine(cfg)
    assert "cannot be checkpointed: vLLM's cpu platform has no sleep mode" in engine.checkpoint_refusal()
    assert asyncio.run(WorkerHost(cfg, engine).run()) == EXIT_BAD_CONFIG
    assert engine.engine is None and list(tmp_path.iterdir()) == []

"""vLLM's CPU build cannot sleep: the worker refuses sleep with a message naming why, before anything
changes; checkpoint mode quiesces without sleep there (and with a level-1 sleep on a GPU), and refuses
by name what it cannot checkpoint. No engine is started here."""

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


def test_checkpoint_mode_is_refused_by_name_where_it_cannot_work(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBINE_SNAPSHOT_CONTROL_DIR", str(tmp_path))
    cfg = parse_worker_args(["--enforce-eager"])
    assert VllmEngine(cfg).checkpoint_refusal() is None  # on CPU: quiesced without sleep mode
    connector = VllmEngine(parse_worker_args(["--enforce-eager", "--disaggregation-mode", "prefill",
                                              "--connector", "nixl"]))
    assert "a KV connector (--connector / --kv-transfer-config)" in connector.checkpoint_refusal()
    # On a GPU it is quiesced by a level-1 sleep, which needs the flag.
    monkeypatch.setattr("turbine.vllm.worker.platform_sleep_refusal", lambda: None)
    gpu = VllmEngine(cfg)
    assert "start it with --enable-sleep-mode" in gpu.checkpoint_refusal()
    assert asyncio.run(WorkerHost(cfg, gpu).run()) == EXIT_BAD_CONFIG
    assert gpu.engine is None and list(tmp_path.iterdir()) == []  # refused before the engine is built


class QuiescingAsyncLLM:
    """Stands in for AsyncLLM in quiesce / resume: notes each call."""

    def __init__(self):
        self.calls = []

    async def pause_generation(self):
        self.calls.append("pause")

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")

    async def resume_generation(self):
        self.calls.append("resume")

    async def sleep(self, level, mode):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags):
        self.calls.append("wake_up")

    async def is_paused(self):
        return False


def test_on_cpu_quiesce_pauses_and_empties_the_caches_and_resume_resumes(monkeypatch):
    monkeypatch.setattr("turbine.vllm.worker.unfinished_requests", lambda engine: 0)
    engine = VllmEngine(parse_worker_args(["--enforce-eager", "--no-enable-prefix-caching"]))
    engine.engine = fake = QuiescingAsyncLLM()
    asyncio.run(engine.quiesce())
    assert fake.calls == ["pause", "reset_prefix_cache", "reset_encoder_cache"]
    asyncio.run(engine.resume())
    assert fake.calls[-1] == "resume"


def test_on_a_gpu_quiesce_is_a_level_1_sleep(monkeypatch):
    monkeypatch.setattr("turbine.vllm.worker.platform_sleep_refusal", lambda: None)
    engine = VllmEngine(parse_worker_args(["--enforce-eager", "--no-enable-prefix-caching"]))
    engine.engine = fake = QuiescingAsyncLLM()
    asyncio.run(engine.quiesce())
    assert fake.calls == [("sleep", 1)]
    asyncio.run(engine.resume())
    assert fake.calls == [("sleep", 1), "wake_up"]


def test_a_restore_gives_the_worker_its_new_identity():
    from turbine.worker.snapshot import RestoredIdentity

    engine = VllmEngine(parse_worker_args(["--enforce-eager"]))
    engine.restore_identity(RestoredIdentity(namespace="ns2", component=None, instance_id="restored-1"))
    assert (engine.instance_id, engine.cfg.namespace) == ("restored-1", "ns2")
    assert engine.cfg.component == parse_worker_args(["--enforce-eager"]).component


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

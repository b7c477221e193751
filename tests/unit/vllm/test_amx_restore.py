"""Checkpoint mode on a CPU with AMX (turbine/vllm/amx.py): the restored worker's processes ask for the tile
state again through Turbine's vLLM worker extension, so a user's own extension is refused by name. The restore
itself runs in tests/integration/test_checkpoint_vllm.py (which, on an AMX host, died of SIGILL without it)."""

from __future__ import annotations

from turbine.vllm import amx
from turbine.vllm.args import parse_worker_args
from turbine.vllm.worker import VllmEngine


def test_the_extension_is_importable_by_the_name_vllm_is_given():
    module, _, name = amx.EXTENSION.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert callable(getattr(cls, amx.RPC))


def test_asking_for_the_tiles_is_harmless_without_amx(monkeypatch):
    monkeypatch.setattr(amx, "has_amx", lambda: False)
    assert amx.request_tiles() is False
    assert amx.RestoredTiles().turbine_request_amx_tiles() is False


def test_on_an_amx_cpu_a_users_worker_extension_is_refused_in_checkpoint_mode(monkeypatch):
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    engine = VllmEngine(parse_worker_args(["--worker-extension-cls", "my.pkg.Extension"]))
    assert "--worker-extension-cls" in engine.checkpoint_refusal()
    monkeypatch.setattr(amx, "has_amx", lambda: False)
    assert engine.checkpoint_refusal() is None
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    assert VllmEngine(parse_worker_args([])).checkpoint_refusal() is None


def test_this_hosts_cpu_flags_are_read():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    amx.has_amx.cache_clear()
    assert amx.has_amx() == ("amx_tile" in flags)

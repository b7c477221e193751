"""The connector's worker half builds its tiers from kv_connector_extra_config (set from the --kv-* flags)."""

from types import SimpleNamespace

from turbine.kvbm import Block
from turbine.vllm.connectors import KvbmTiers, kvbm_config
from turbine.vllm.kvbm_connector import build_store


def vllm_config(extra: dict):
    mc = SimpleNamespace(model="m", dtype="float32", get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1,
                         get_head_size=lambda: 8)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
                           parallel_config=None, kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_disk_min_uses_flag_reaches_the_store(tmp_path):
    extra = kvbm_config(KvbmTiers(host_gb=0.01, disk_gb=0.01, disk_dir=str(tmp_path), disk_min_uses=2))
    store = build_store(vllm_config(extra["kv_connector_extra_config"]))
    assert [t.name for t in store.tiers] == ["host", "disk"] and store.min_uses == {"disk": 2}
    assert store.put(Block(1, None, 16, b"x" * 64)) == ["host"]  # used once: kept off the disk
    unfiltered = build_store(vllm_config(kvbm_config(KvbmTiers(disk_gb=0.01, disk_dir=str(tmp_path / "u")))
                                         ["kv_connector_extra_config"]))
    assert unfiltered.min_uses == {} and unfiltered.put(Block(1, None, 16, b"x" * 64)) == ["disk"]

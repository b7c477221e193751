"""The kvbm connector's scheduler half checks each file block before offering it to vLLM, so that a load
never meets a corrupt file (a failed load is what vLLM 0.26 on a GPU does not survive: docs/benchmarks/gpu.md).
Both halves are real; their tiers are real directories; the engine's cache is a stub."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from turbine.kvbm import Block  # noqa: E402
from turbine.kvbm.block import HEADER_SIZE  # noqa: E402
from turbine.kvbm.files import SETTLED_NS  # noqa: E402
from turbine.router.hashing import block_hashes  # noqa: E402
from turbine.vllm.connectors import KvbmTiers, kvbm_config  # noqa: E402
from turbine.vllm import kvbm_connector  # noqa: E402
from turbine.vllm.kvbm_connector import KvbmMetadata, TurbineKvbmConnector  # noqa: E402

BS = 4
PAYLOAD = 64
TOKENS = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks and the token the engine must compute
HASHES = block_hashes(TOKENS[:3 * BS], BS)


def halves(tmp_path, put: bool = True) -> tuple[TurbineKvbmConnector, TurbineKvbmConnector]:
    extra = kvbm_config(KvbmTiers(disk_gb=0.01, disk_dir=str(tmp_path / "disk"), shared_gb=0.01,
                                  shared_dir=str(tmp_path / "shared")))["kv_connector_extra_config"]
    mc = SimpleNamespace(model="m", dtype="float32", get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1,
                         get_head_size=lambda: 8)
    config = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS),
                             parallel_config=SimpleNamespace(world_size=1, data_parallel_size=1),
                             kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[object()], num_blocks=8)
    scheduler = TurbineKvbmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = TurbineKvbmConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker._blocks = SimpleNamespace(block_nbytes=PAYLOAD, loaded=[], begin_loads=lambda: None)
    worker._blocks.load = worker._blocks.loaded.extend
    # The prompt's blocks were computed earlier: in both file tiers, and the scheduler half's mirror knows.
    for i, h in enumerate(HASHES if put else []):
        worker.store.put(Block(h, HASHES[i - 1] if i else None, BS, bytes([i]) * PAYLOAD))
    sync(scheduler, worker)
    return scheduler, worker


def sync(scheduler: TurbineKvbmConnector, worker: TurbineKvbmConnector) -> None:
    """The worker's tier events to the scheduler half, as after an engine step."""
    scheduler.update_connector_output(SimpleNamespace(invalid_block_ids=set(),
                                                      kv_connector_worker_meta=worker.build_connector_worker_meta()))


def offer(scheduler: TurbineKvbmConnector, req_id: str = "r") -> int:
    request = SimpleNamespace(request_id=req_id, prompt_embeds=None, mm_features=None, lora_request=None,
                              all_token_ids=TOKENS, num_tokens=len(TOKENS))
    scheduler.on_new_request(request)
    tokens, is_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert not is_async
    return tokens


def step(scheduler: TurbineKvbmConnector, worker: TurbineKvbmConnector, load_errors: frozenset = frozenset()
         ) -> KvbmMetadata:
    """The scheduler half's metadata for one step (no forward pass), run by the worker half."""
    meta = scheduler.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == load_errors
    sync(scheduler, worker)
    return meta


def damage(tier, h: int) -> str:
    path = f"{tier.directory}/{h:016x}.kvb"
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 3)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def counter(worker: TurbineKvbmConnector, attr: str, tier: str) -> float:
    return getattr(worker.store.metrics, attr).labels(tier)._value.get()


def test_good_file_blocks_are_offered_and_a_corrupt_one_is_not(tmp_path):
    scheduler, worker = halves(tmp_path)
    disk, shared = worker.store.tiers
    assert offer(scheduler, "good") == 3 * BS  # every file verified: the whole prefix offered
    scheduler.request_finished(SimpleNamespace(request_id="good"), [])

    # Block 1 damaged in both file tiers: the offer stops before it, and neither bad file is left.
    bad_disk, bad_shared = damage(disk, HASHES[1]), damage(shared, HASHES[1])
    assert offer(scheduler) == BS
    assert not (tmp_path / bad_disk).exists() and not (tmp_path / bad_shared).exists()
    assert scheduler._lookups["r"][2] == ["disk"]
    # The worker half drops the block from both tiers and counts it with the corruption its own reads find.
    meta = step(scheduler, worker)
    assert sorted(meta.corrupt) == [("disk", HASHES[1]), ("shared", HASHES[1])]
    assert counter(worker, "corrupt", "disk") == 1 and counter(worker, "corrupt", "shared") == 1
    assert worker.store.locate(HASHES[1]) is None and worker.store.locate(HASHES[0]) == "disk"
    assert scheduler._where.get(HASHES[1]) is None  # the mirror followed (and the router's stream with it)
    assert worker.store.metrics.load_errors._value.get() == 0
    assert offer(scheduler, "again") == BS  # nothing more to find: no file, no second count
    assert step(scheduler, worker).corrupt == []


def test_a_corrupt_disk_copy_falls_back_to_a_good_shared_one(tmp_path):
    scheduler, worker = halves(tmp_path)
    disk, _ = worker.store.tiers
    damage(disk, HASHES[1])
    assert offer(scheduler) == 3 * BS
    assert scheduler._lookups["r"][2] == ["disk", "shared", "disk"]
    assert step(scheduler, worker).corrupt == [("disk", HASHES[1])]
    assert worker.store.tiers_of(HASHES[1]) == {"shared"} and counter(worker, "corrupt", "disk") == 1


def test_a_verified_file_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    scheduler, worker = halves(tmp_path)
    disk, _ = worker.store.tiers
    assert offer(scheduler, "a") == 3 * BS
    reads = []
    import turbine.kvbm.files as files
    real_decode = files.decode
    monkeypatch.setattr(files, "decode", lambda raw, h: reads.append(h) or real_decode(raw, h))
    assert offer(scheduler, "b") == 3 * BS and reads == []  # unchanged files: remembered
    damage(disk, HASHES[2])  # a write moves the file's mtime: read again, found bad
    # The disk copy read and found bad, then the shared copy (never checked before) read and found good.
    assert offer(scheduler, "c") == 3 * BS and reads == [HASHES[2], HASHES[2]]


def test_files_the_worker_half_wrote_are_offered_without_a_read_once_settled(tmp_path, monkeypatch):
    """The worker half sends the identity of each file it wrote once the file's mtime is past the clock's tick
    (a later edit moves it): the scheduler half then offers the block without reading the file first."""
    scheduler, worker = halves(tmp_path)
    disk, _ = worker.store.tiers
    time.sleep(SETTLED_NS / 1e9 + 0.02)
    sync(scheduler, worker)
    reads = []
    import turbine.kvbm.files as files
    real_decode = files.decode
    monkeypatch.setattr(files, "decode", lambda raw, h: reads.append(h) or real_decode(raw, h))
    assert offer(scheduler, "a") == 3 * BS and reads == []
    assert worker._unsettled == {}
    damage(disk, HASHES[2])  # edited after it settled: the identity moved, so it is read (bad), then the shared copy
    assert offer(scheduler, "b") == 3 * BS and reads == [HASHES[2]]


def test_files_an_earlier_run_left_are_read_before_they_are_offered(tmp_path, monkeypatch):
    """A restarted worker finds the disk tier's files (a crash may have left one short): they reach the mirror,
    but not as written by this process, so the scheduler half reads each before offering it."""
    halves(tmp_path)
    time.sleep(SETTLED_NS / 1e9 + 0.02)
    scheduler, worker = halves(tmp_path, put=False)  # the same directories, a new process
    assert worker.store.tiers_of(HASHES[0]) == {"disk"}
    reads = []
    import turbine.kvbm.files as files
    real_decode = files.decode
    monkeypatch.setattr(files, "decode", lambda raw, h: reads.append(h) or real_decode(raw, h))
    assert offer(scheduler) == 3 * BS and reads == HASHES


@pytest.mark.parametrize("part", [64, 1], ids=["one part", "a part per block"])
def test_a_file_damaged_after_its_check_is_the_worker_halfs_load_error(tmp_path, monkeypatch, part):
    """The second guard: a file that changes between the check and the load (one step) fails the worker half's
    own check; the block and the rest of the prompt's offer are reported to vLLM (recomputed) and counted, also
    when the rest is read in later parts of the step's load."""
    monkeypatch.setattr(kvbm_connector, "LOAD_PART", part)
    scheduler, worker = halves(tmp_path)
    disk, shared = worker.store.tiers
    assert offer(scheduler) == 3 * BS
    scheduler.update_state_after_alloc(scheduler._tracked["r"].request,
                                       SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 3 * BS)
    damage(disk, HASHES[1]), damage(shared, HASHES[1])
    meta = step(scheduler, worker, load_errors=frozenset({6, 7}))
    assert [block_id for _, block_id, _ in meta.loads] == [5, 6, 7] and meta.corrupt == []
    assert [len(data) for _, data in worker._blocks.loaded] == [PAYLOAD]  # block 0 alone reached the engine
    assert worker.store.metrics.load_errors._value.get() == 2
    assert counter(worker, "corrupt", "disk") == 1 and counter(worker, "corrupt", "shared") == 1

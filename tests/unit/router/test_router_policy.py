"""The routing home: the policy registry, the one KV-router config and its flags, and the KV-aware
policy's decisions over LoRA adapters and data-parallel ranks."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from turbine.config import ConfigError
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.generate import GenerateRequest
from turbine.protocol.kv_events import BlockStored
from turbine.protocol.load_metrics import LoadMetrics
from turbine.router.config import KvRouterConfig, add_kv_router_args, kv_router_config_from_args
from turbine.router.hashing import block_hashes
from turbine.router.indexer import WorkerKey
from turbine.router.metrics import RouterMetrics
from turbine.router.policy import (
    KvAwareRouter,
    RoundRobinRouter,
    Router,
    RouterConfig,
    Target,
    _POLICIES,
    make_router,
    register_policy,
    router_modes,
)

BS = 16
SYSTEM = list(range(100, 100 + 4 * BS))  # a 4-block prefix


def card(instance_id: str, dp: int = 1, block_size: int = BS) -> ModelCard:
    return ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                     tokenizer_path="", context_length=4096, kv_block_size=block_size, total_kv_blocks=100,
                     max_num_seqs=8, max_num_batched_tokens=512, data_parallel_size=dp)


def record(instance_id: str) -> InstanceRecord:
    return InstanceRecord(namespace="n", component="c", endpoint="generate", instance_id=instance_id,
                          address=f"127.0.0.1:{1000 + len(instance_id)}")


def request(rid: str, tokens: list[int], lora: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", token_ids=tokens, lora_name=lora)


def stored(tokens: list[int], first_hash: int = 1) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored.from_token_ids(block_hashes=list(range(first_hash, first_hash + n)), parent_hash=None,
                                      token_ids=tokens, block_size=BS)


@pytest.fixture
async def kv():
    """A KV-aware router over instance "a" (2 data-parallel ranks) and "b" (1)."""
    metrics = RouterMetrics(CollectorRegistry())
    router = make_router(RouterConfig(mode="kv"), card("a"), metrics)
    router.instances_changed([record("a"), record("b")], {"a": card("a", dp=2), "b": card("b")})
    yield router
    router.core.close()


# -- registry and config -----------------------------------------------------------------
def test_the_registry_names_the_built_in_policies_and_takes_more():
    assert router_modes() == ("round-robin", "random", "kv")

    class Sticky(Router):
        def select(self, instances, request):
            return Target(instances[0], 0)

    register_policy("sticky-test", lambda cfg, card, metrics: Sticky())
    try:
        assert "sticky-test" in router_modes()
        router = make_router(RouterConfig(mode="sticky-test"), card("a"))
        assert router.select([record("a")], request("r", [1])) == Target(record("a"), 0)
        with pytest.raises(ValueError, match="registered already"):
            register_policy("sticky-test", lambda cfg, card, metrics: Sticky())
    finally:
        del _POLICIES["sticky-test"]


def test_configs_check_themselves_and_name_the_flag():
    with pytest.raises(ConfigError, match=r"RouterConfig.mode \(--router-mode\): 'nope': choose from "
                                          r"round-robin, random, kv"):
        RouterConfig(mode="nope")
    for kwargs, flag in (({"overlap_weight": -1}, "--router-kv-overlap-score-weight"),
                         ({"temperature": -0.1}, "--router-temperature"),
                         ({"events_deadline_s": 0}, "--router-kv-events-deadline")):
        with pytest.raises(ConfigError, match=flag):
            KvRouterConfig(**kwargs)
    with pytest.raises(ConfigError, match="approx_ttl_s"):
        KvRouterConfig(approx_ttl_s=0)


def test_the_flags_keep_their_defaults():
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    assert kv_router_config_from_args(parser.parse_args([]), parser) == KvRouterConfig()
    assert KvRouterConfig() == KvRouterConfig(overlap_weight=4.0, temperature=0.0, use_kv_events=True,
                                              events_deadline_s=10.0, approx_ttl_s=120.0)
    cfg = kv_router_config_from_args(parser.parse_args(
        ["--router-kv-overlap-score-weight", "2", "--router-temperature", "0.3", "--no-router-kv-events",
         "--router-kv-events-deadline", "4"]), parser)
    assert cfg == KvRouterConfig(overlap_weight=2.0, temperature=0.3, use_kv_events=False, events_deadline_s=4.0)


def test_a_bad_flag_exits_naming_it(capsys):
    parser = argparse.ArgumentParser()
    add_kv_router_args(parser)
    with pytest.raises(SystemExit):
        kv_router_config_from_args(parser.parse_args(["--router-temperature", "-1"]), parser)
    assert "KvRouterConfig.temperature (--router-temperature): must be >= 0" in capsys.readouterr().err


def test_round_robin_and_random_leave_the_rank_to_the_worker():
    insts = [record("a"), record("b")]
    for mode in ("round-robin", "random"):
        router = make_router(RouterConfig(mode=mode), card("a", dp=2))
        assert all(router.select(insts, request(f"r{i}", SYSTEM)).dp_rank is None for i in range(4))
    assert isinstance(make_router(RouterConfig(), card("a")), RoundRobinRouter)


# -- LoRA ------------------------------------------------------------------------------
async def test_the_same_prompt_under_two_adapters_shares_no_cached_blocks(kv):
    assert isinstance(kv, KvAwareRouter)
    core = kv.core
    core.kv.index.apply(WorkerKey("b"), stored(SYSTEM), lora_name="x")  # cached on b under adapter x
    # b is a little busier than a's ranks, so only a cached prefix draws a request there.
    core.kv.loads.report(WorkerKey("b"), LoadMetrics(instance_id="b", kv_active_blocks=3, kv_total_blocks=100,
                                                     num_running=1, num_waiting=0))
    prompt = SYSTEM + [1, 2, 3]
    assert kv.select([record("a"), record("b")], request("with-x", prompt, lora="x")) == Target(record("b"), 0)
    assert core.kv.loads.pending(WorkerKey("b")).prefill_tokens == 3  # only the uncached tail
    for rid, lora in (("with-y", "y"), ("base", None)):
        target = kv.select([record("a"), record("b")], request(rid, prompt, lora=lora))
        assert target.instance.instance_id == "a"
        assert core.kv.loads.pending(WorkerKey("a", target.dp_rank)).prefill_tokens == len(prompt)


# -- data-parallel ranks ---------------------------------------------------------------
async def test_a_prefix_held_by_rank_1_routes_to_rank_1(kv):
    kv.core.kv.index.apply(WorkerKey("a", 1), stored(SYSTEM))
    for i in range(3):
        target = kv.select([record("a"), record("b")], request(f"r{i}", SYSTEM + [i]))
        assert (target.instance.instance_id, target.dp_rank) == ("a", 1)
        kv.first_token(f"r{i}")
        kv.finished(f"r{i}")


async def test_a_burst_without_a_cached_prefix_spreads_over_every_rank_by_load(kv):
    placed = Counter()
    for i in range(9):
        target = kv.select([record("a"), record("b")], request(f"r{i}", list(range(i * 1000, i * 1000 + 4 * BS))))
        placed[(target.instance.instance_id, target.dp_rank)] += 1
    assert placed == {("a", 0): 3, ("a", 1): 3, ("b", 0): 3}, placed


async def test_a_retry_among_fewer_instances_still_considers_their_ranks(kv):
    kv.core.kv.index.apply(WorkerKey("a", 1), stored(SYSTEM))
    assert kv.select([record("b")], request("r", SYSTEM)) == Target(record("b"), 0)
    ranks = {kv.select([record("a")], request(f"q{i}", list(range(i * 1000, i * 1000 + BS)))).dp_rank
             for i in range(4)}
    assert ranks == {0, 1}


async def test_an_instance_that_leaves_takes_every_rank_with_it(kv):
    core = kv.core
    for rank in (0, 1):
        core.kv.index.apply(WorkerKey("a", rank), stored(SYSTEM, first_hash=1 + 10 * rank))
        core.kv.loads.report(WorkerKey("a", rank), LoadMetrics(instance_id="a", dp_rank=rank, kv_active_blocks=5,
                                                                kv_total_blocks=100, num_running=1, num_waiting=0))
    kv.select([record("a")], request("r", SYSTEM + [1]))
    kv.instances_changed([record("b")], {"b": card("b")})
    for rank in (0, 1):
        worker = WorkerKey("a", rank)
        assert core.kv.index.blocks_of(worker) == 0 and core.kv.loads.reported(worker) is None
        assert core.kv.loads.pending(worker).active_blocks == 0
    assert core.kv.index.find_matches(block_hashes(SYSTEM, BS)) == {}
    assert kv.select([record("b")], request("s", SYSTEM)).instance.instance_id == "b"


async def test_per_worker_metrics_label_each_rank(kv):
    kv.core.kv.index.apply(WorkerKey("a", 1), stored(SYSTEM))
    kv.core.kv.loads.report(WorkerKey("a", 1), LoadMetrics(instance_id="a", dp_rank=1, kv_active_blocks=7,
                                                            kv_total_blocks=100, num_running=2, num_waiting=0))
    kv.select([record("a"), record("b")], request("r", SYSTEM + [1]))
    kv.export_metrics()
    m = kv.core.metrics

    def series(gauge):
        return {s.labels["worker"]: s.value for metric in gauge.collect() for s in metric.samples}

    assert series(m.indexed_blocks) == {"a": 0, "a/1": 4, "b": 0}
    assert series(m.worker_active_blocks) == {"a/1": 7}
    assert series(m.worker_pending_blocks)["a/1"] == 1  # the first output token's block


# -- images (issue #19) ---------------------------------------------------------------------
IMAGE = 7  # the image token id of the cards below
RED, BLUE = "ab" * 32, "cd" * 32  # two images' content hashes (hex)


def test_media_keys_follow_each_image_token_and_spare_the_text_before():
    from turbine.router.hashing import media_keyed_ids

    ids = [*SYSTEM, IMAGE, 1, 2, IMAGE, 3]
    keyed = media_keyed_ids(ids, IMAGE, [RED, BLUE])
    assert len(keyed) == len(ids) + 8 and keyed[:len(SYSTEM) + 1] == [*SYSTEM, IMAGE]
    assert keyed[len(SYSTEM) + 5:len(SYSTEM) + 7] == [1, 2] and keyed[-1] == 3
    assert all(t >= 1 << 31 for t in keyed[len(SYSTEM) + 1:len(SYSTEM) + 5])  # beyond any vocabulary
    assert media_keyed_ids(ids, IMAGE, []) == ids
    # No known image token: the keys go first (the whole prompt keyed by its images).
    assert media_keyed_ids(ids, None, [RED])[4:] == ids and media_keyed_ids(ids, None, [RED])[:4] != ids[:4]
    prompt = [*SYSTEM, IMAGE, *range(200, 200 + 2 * BS)]
    red, blue = (block_hashes(media_keyed_ids(prompt, IMAGE, [h]), BS) for h in (RED, BLUE))
    # The 4 system blocks match; from the image's block on, another image is another prefix.
    assert red[:4] == blue[:4] and not set(red[4:]) & set(blue[4:])


async def test_approximate_routing_keeps_different_images_apart():
    from turbine.protocol.generate import ImageInput
    from turbine.router.config import KvRouterConfig

    mm_card = card("a")
    mm_card.image_token_id = IMAGE
    router = make_router(RouterConfig(mode="kv", kv=KvRouterConfig(use_kv_events=False)), mm_card,
                         RouterMetrics(CollectorRegistry()))
    router.instances_changed([record("a"), record("b")], {"a": card("a"), "b": card("b")})
    try:
        prompt = [*SYSTEM, IMAGE, *range(200, 200 + 2 * BS)]

        def req(rid, h):
            return GenerateRequest(request_id=rid, model="m", token_ids=prompt, images=[ImageInput(data=b"", hash=h)])

        first = router.select([record("a"), record("b")], req("r1", RED))
        router.finished("r1")
        index = router.core.kv.index
        from turbine.router.hashing import media_keyed_ids
        for h, blocks in ((RED, 6), (BLUE, 4)):
            matches = index.find_matches(block_hashes(media_keyed_ids(prompt, IMAGE, [h]), BS))
            assert matches.get(WorkerKey(first.instance.instance_id, 0), 0) == blocks
    finally:
        router.core.close()

"""The mocker's simulated KV tiers (--kv-host-cache-gb, --kv-disk-cache-gb): blocks the engine
evicts stay in the tiers, a returning prefix is loaded at the bandwidth model's cost instead of
recomputed, and the consolidated tier events (stored on first appearance and when the fastest tier
changes, removed only when gone from every tier) are what the real router's index follows."""

from __future__ import annotations

import itertools

import pytest

from turbine.mocker.args import GIB, parse_mocker_args
from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.kv_tiers import KvTiers, TierSpec
from turbine.mocker.scheduler import FINISHED, Scheduler, Sequence
from turbine.mocker.timing import TimingProfile
from turbine.mocker.tokens import Choice, TokenSampler, prompt_seed
from turbine.protocol.kv_events import BlockRemoved, BlockStored
from turbine.router.config import KvRouterConfig
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.kv_router import KvRouter

BS = 16
BLOCK_BYTES = 23040 * BS  # SmolLM2-135M's KV per token (2-byte dtype) x the block size
HOST_BW, DISK_BW = 2.1e9, 1.6e9
SAMPLER = TokenSampler(500, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)
W = WorkerKey("w")
_ids = itertools.count()


def make_seq(prompt: list[int], max_tokens: int = 1) -> Sequence:
    choice = Choice(seed=prompt_seed(prompt), index=0, min_tokens=0, stop_token_ids=frozenset(), ignore_eos=True)
    return Sequence(seq_id=f"s{next(_ids)}", choice=choice, tokens=list(prompt), num_prompt_tokens=len(prompt),
                    max_tokens=max_tokens)


def prompt(first: int, blocks: int) -> list[int]:
    """`blocks` full blocks of distinct tokens and one more token (so they are all loadable)."""
    return list(range(first, first + blocks * BS)) + [7]


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, event, lora_name=None):
        self.events.append(event)

    def tier_events(self):
        return [e for e in self.events if getattr(e, "tier", None) is not None]


def make(num_blocks: int, specs: list[TierSpec] | None, budget: int = 4096):
    rec = Recorder()
    pool = BlockPool(num_blocks, BS, on_event=rec)
    tiers = KvTiers(specs, BS, BLOCK_BYTES, on_event=rec) if specs else None
    sched = Scheduler(pool, SAMPLER, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=num_blocks * BS,
                      tiers=tiers)
    return sched, rec


def run(sched: Scheduler, seq: Sequence) -> list:
    """Serves one sequence to the end; returns its steps."""
    sched.add(seq)
    steps = []
    while seq.status != FINISHED:
        step = sched.schedule()
        steps.append(step)
        sched.complete(step)
    return steps


HOST = [TierSpec("host", 64, HOST_BW)]


def test_a_block_the_engine_evicts_stays_in_the_host_tier():
    sched, rec = make(7, HOST)
    a = make_seq(prompt(1000, 6))
    run(sched, a)
    router_hashes = block_hashes(a.tokens, BS)
    assert sched.tiers.match(router_hashes) == ["host"] * len(router_hashes)
    run(sched, make_seq(prompt(5000, 6)))  # another prompt takes all 7 of the engine's blocks
    assert not sched.pool.lookup(a.hashes[:6])  # gone from the engine ...
    assert sched.tiers.match(router_hashes[:6]) == ["host"] * 6  # ... still in the tier
    assert not [e for e in rec.tier_events() if isinstance(e, BlockRemoved)]


def test_a_returning_prefix_is_loaded_at_the_bandwidth_cost_not_recomputed():
    profile = TimingProfile()

    def returning(specs):
        sched, _ = make(7, specs)
        run(sched, make_seq(prompt(1000, 6)))
        run(sched, make_seq(prompt(5000, 6)))  # evicts the first prompt from the engine
        again = make_seq(prompt(1000, 6))
        step = run(sched, again)[0]
        return again, step, profile.step_ms(step.prefill_tokens, step.prefill_pairs, 0, 0) + step.onboard_s * 1000

    seq, step, ms = returning(HOST)
    assert seq.num_cached_tokens == 6 * BS  # counted as cached, as vLLM counts a connector's tokens
    assert step.prefill_tokens == 1  # only the last token is computed
    assert step.onboard_s == pytest.approx(6 * BLOCK_BYTES / HOST_BW)
    without, step0, recompute_ms = returning(None)
    assert without.num_cached_tokens == 0 and step0.prefill_tokens == 6 * BS + 1 and step0.onboard_s == 0
    # 6 blocks loaded (~1 ms) against 96 tokens computed (~120 ms); the step's base time (27 ms) is in both.
    assert ms < recompute_ms / 4
    assert step.onboard_s * 1000 < (recompute_ms - ms) / 50


def test_a_disk_block_costs_the_disk_bandwidth_and_is_promoted_to_host():
    sched, rec = make(7, [TierSpec("host", 6, HOST_BW), TierSpec("disk", 64, DISK_BW)])
    a = make_seq(prompt(1000, 6))
    run(sched, a)
    hashes = block_hashes(a.tokens, BS)[:6]
    run(sched, make_seq(prompt(5000, 6)))  # its 6 blocks push a's out of the engine and out of host
    assert sched.tiers.match(hashes) == ["disk"] * 6
    step = run(sched, make_seq(prompt(1000, 6)))[0]
    assert step.onboard_s == pytest.approx(6 * BLOCK_BYTES / DISK_BW)
    assert sched.tiers.match(hashes) == ["host"] * 6  # promoted
    assert sched.tiers.counts["disk"].hits == 6 and sched.tiers.counts["host"].hits == 0


def test_a_load_from_a_full_tier_comes_before_the_new_blocks_are_saved():
    # The tier is full of the prompt's history, least recent first; the returning prompt loads all of it
    # and computes one new block, whose save evicts the tier's least recent block.
    sched, rec = make(8, [TierSpec("host", 6, HOST_BW)])
    a = make_seq(prompt(1000, 6))
    run(sched, a)
    assert sched.pool.reset()  # the engine's cache dropped (as clear_kv_blocks); the tier keeps its blocks
    longer = a.tokens[:6 * BS] + list(range(3000, 3000 + BS)) + [7]
    seq = make_seq(longer)
    step = run(sched, seq)[0]
    assert seq.num_cached_tokens == 6 * BS and step.prefill_tokens == BS + 1
    assert step.onboard_s == pytest.approx(6 * BLOCK_BYTES / HOST_BW)
    assert sched.tiers.num_blocks("host") == 6


def test_promoting_a_block_may_push_the_next_one_out_of_a_small_host_tier():
    tiers = KvTiers([TierSpec("host", 2, HOST_BW), TierSpec("disk", 10, DISK_BW)], BS, BLOCK_BYTES)
    tiers.save([1, 2, 3])  # host keeps 2 and 3, disk all three
    found = tiers.match([1, 2, 3])
    assert found == ["disk", "host", "host"]
    # Block 1's promotion evicts block 2 from host before block 2 is read: still one load each.
    assert tiers.load([1, 2, 3], found) == pytest.approx(BLOCK_BYTES / DISK_BW + 2 * BLOCK_BYTES / HOST_BW)
    assert tiers.match([1, 2, 3]) == ["host", "disk", "host"]


def test_the_consolidated_events_follow_the_fastest_tier_and_remove_only_when_gone_from_all():
    tiers_events = Recorder()
    tiers = KvTiers([TierSpec("host", 2, HOST_BW), TierSpec("disk", 3, DISK_BW)], BS, BLOCK_BYTES,
                    on_event=tiers_events)
    tiers.save([1, 2])
    assert [(type(e), e.tier, e.block_hashes) for e in tiers_events.events] == [(BlockStored, "host", [1, 2])]
    assert all(e.block_size == BS and e.tokens == b"" and e.parent_hash is None for e in tiers_events.events)
    tiers_events.events.clear()
    tiers.save([3])  # host (2 blocks) drops 1, which disk still holds: its fastest tier is disk now
    assert [(type(e), e.tier, e.block_hashes) for e in tiers_events.events] == [
        (BlockStored, "host", [3]), (BlockStored, "disk", [1])]
    tiers_events.events.clear()
    tiers.save([4])  # disk (3 blocks) drops 1: gone from every tier. Host drops 2, still on disk.
    kinds = [(type(e), e.tier, e.block_hashes) for e in tiers_events.events]
    assert (BlockRemoved, "disk", [1]) in kinds and (BlockStored, "disk", [2]) in kinds
    assert not [k for k in kinds if k[0] is BlockRemoved and k[2] != [1]]
    tiers_events.events.clear()
    tiers.save([3])  # held already: nothing written, nothing said
    assert tiers_events.events == [] and tiers.counts["host"].stored == 4


def test_the_real_router_index_follows_the_mockers_engine_and_tier_events():
    sched, rec = make(7, [TierSpec("host", 12, HOST_BW)])
    index = KvIndexer(BS)
    a = make_seq(prompt(1000, 6))
    run(sched, a)
    hashes = block_hashes(a.tokens, BS)[:6]
    run(sched, make_seq(prompt(5000, 6)))
    for event in rec.events:
        index.apply(W, event)
    assert index.find_matches(hashes) == {}  # the engine evicted them
    assert index.tier_matches(hashes, [W], {}) == {W: ["host"] * 6}  # the router still sees them on W
    # Router-level: W is preferred over an idle worker holding nothing, and not with --no-router-kv-tiers.
    other = WorkerKey("other")
    aware, engine_only = KvRouter(KvRouterConfig(), BS), KvRouter(KvRouterConfig(use_kv_tiers=False), BS)
    for router in (aware, engine_only):
        for event in rec.events:
            router.index.apply(W, event)
    assert aware.decide("r", prompt(1000, 6), [W, other], track=False).worker == W
    costs = engine_only.decide("r", prompt(1000, 6), [W, other], track=False).costs
    assert costs[W] == costs[other]
    # More prompts push a's blocks out of the tier too: removed from the router's index.
    run(sched, make_seq(prompt(9000, 6)))
    for event in rec.events:
        index.apply(W, event)
    assert index.tier_matches(hashes, [W], {}).get(W, []) != ["host"] * 6


def test_tier_flags_make_the_specs(model_dir):
    cfg = parse_mocker_args(["--block-size", "64", "--kv-host-cache-gb", "1", "--kv-disk-cache-gb", "4",
                             "--kv-disk-bandwidth", "0.5"])
    block = 23040 * 64
    assert cfg.kv_block_bytes == block
    assert cfg.kv_tiers == [TierSpec("host", GIB // block, 2.1e9), TierSpec("disk", 4 * GIB // block, 0.5e9)]
    assert parse_mocker_args([]).kv_tiers == []
    # As the real worker's `--connector kvbm nixl`: a prefill worker takes tiers (a decode worker does not, below).
    assert parse_mocker_args(["--kv-host-cache-gb", "1", "--disaggregation-mode", "prefill"]).kv_tiers


@pytest.mark.parametrize("argv,flag", [
    (["--kv-host-cache-gb", "0"], "--kv-host-cache-gb"),
    (["--kv-host-cache-gb", "0.000001"], "--kv-host-cache-gb"),  # less than one block: an inert tier
    (["--kv-host-bandwidth", "3"], "--kv-host-bandwidth"),  # no host tier to load from
    (["--kv-disk-bandwidth", "3", "--kv-host-cache-gb", "1"], "--kv-disk-bandwidth"),
    (["--kv-host-cache-gb", "1", "--kv-host-bandwidth", "0"], "--kv-host-bandwidth"),
    (["--kv-host-cache-gb", "1", "--no-enable-prefix-caching"], "--kv-host-cache-gb"),
    (["--kv-disk-cache-gb", "1", "--disaggregation-mode", "decode"], "--kv-disk-cache-gb"),
])
def test_bad_tier_flags_name_the_flag(argv, flag, capsys, model_dir):
    with pytest.raises(SystemExit) as info:
        parse_mocker_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


async def test_a_worker_publishes_its_tier_events_and_counts_them(model_dir):
    import asyncio

    from prometheus_client import REGISTRY

    from turbine.mocker.tokens import TokenSampler as Sampler
    from turbine.mocker.worker import SimulatedWorker, WorkerEngines
    from turbine.protocol.generate import GenerateRequest, StopConditions
    from turbine.runtime.event_plane import WorkerEventPlane
    from turbine.runtime.status_server import Health

    cfg = parse_mocker_args(["--speedup-ratio", "0", "--kv-host-cache-gb", "0.01"])  # 7 blocks of 64
    info = cfg.model_info
    sampler = Sampler(info.vocab_size, info.eos_token_ids, info.special_token_ids, 0)
    w = SimulatedWorker(cfg, WorkerEngines(cfg, sampler), Health(), WorkerEventPlane("zmq", "127.0.0.1"), "tiers-w")
    task = asyncio.create_task(w.engines[0].run())
    try:
        tokens = list(range(1000, 1200))  # 3 full blocks of 64
        req = GenerateRequest(request_id="r", model="m", token_ids=tokens, stop=StopConditions(max_tokens=1))
        [c async for c in w.handlers.generate(req, None)]
        state = w.events.kv[0].state  # what the publisher sent (and would replay)
        tier_batches = [e for b in state.snapshot("tiers-w", 0, 0) for e in b.events if getattr(e, "tier", None)]
        assert {h for e in tier_batches for h in e.block_hashes} == set(block_hashes(tokens, 64))
        w.refresh_gauges()
        labels = {"namespace": cfg.namespace, "component": cfg.component, "model": cfg.served_model_name,
                  "worker_id": "tiers-w", "tier": "host"}
        assert REGISTRY.get_sample_value("turbine_mocker_kvbm_blocks_stored_total", labels) == 3
        assert REGISTRY.get_sample_value("turbine_mocker_kvbm_tier_blocks", labels) == 3
    finally:
        task.cancel()
        w.close()

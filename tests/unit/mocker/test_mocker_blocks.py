"""The mocker's KV block pool and scheduler: accounting never leaks, prefix reuse, LRU
eviction (suffix before prefix), preemption by recompute, and KV events that mirror the cache."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.scheduler import FINISHED, Scheduler, Sequence
from turbine.mocker.timing import TimingProfile
from turbine.mocker.tokens import Choice, TokenSampler, prompt_seed
from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

VOCAB = 500
SAMPLER = TokenSampler(VOCAB, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)
_ids = itertools.count()


def make_seq(prompt: list[int], max_tokens: int, index: int = 0) -> Sequence:
    choice = Choice(seed=prompt_seed(prompt), index=index, min_tokens=0, stop_token_ids=frozenset(),
                    ignore_eos=True)
    return Sequence(seq_id=f"s{next(_ids)}", choice=choice, tokens=list(prompt), num_prompt_tokens=len(prompt),
                    max_tokens=max_tokens)


class Mirror:
    """What a KV-aware router would know about the cache from the events alone."""

    def __init__(self):
        self.hashes: set[int] = set()
        self.events = []

    def removed_since(self, start: int) -> list[int]:
        return [h for ev in self.events[start:] if isinstance(ev, BlockRemoved) for h in ev.block_hashes]

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert not self.hashes & set(ev.block_hashes), "a hash was stored twice"
            self.hashes |= set(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= self.hashes, "removed a hash never stored"
            self.hashes -= set(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            self.hashes.clear()


def make_scheduler(num_blocks: int, block_size: int, *, max_num_seqs: int = 8, budget: int = 32,
                   caching: bool = True):
    # As the mocker enforces at start-up, one sequence of the full context fits in the pool.
    max_model_len = num_blocks * block_size
    mirror = Mirror()
    pool = BlockPool(num_blocks, block_size, enable_caching=caching, on_event=mirror)
    sched = Scheduler(pool, SAMPLER, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len)
    return sched, mirror


def check_consistent(sched: Scheduler, mirror: Mirror) -> None:
    pool = sched.pool
    assert all(not s.blocks for s in sched.waiting), "a waiting sequence holds blocks"
    holders = Counter(b for s in sched.running for b in s.blocks)
    assert pool.ref_counts == [holders[b] for b in range(pool.num_blocks)]
    in_use = {b for b, r in enumerate(pool.ref_counts) if r > 0}
    empty, evictable = set(pool.empty), set(pool.evictable)
    assert len(empty) == len(pool.empty)
    assert not (in_use & empty or in_use & evictable or empty & evictable)
    assert len(in_use) + len(empty) + len(evictable) == pool.num_blocks
    assert all(pool.block_hashes[b] is None for b in empty)
    assert all(pool.block_hashes[b] is not None for b in evictable)
    assert pool.cached == {h: b for b, h in enumerate(pool.block_hashes) if h is not None}
    assert mirror.hashes == set(pool.cached)


def run_until_idle(sched: Scheduler, timing: TimingProfile | None = None, mirror: Mirror | None = None,
                   max_steps: int = 20_000) -> dict[Sequence, float]:
    """Step until no work is left; returns each sequence's simulated time to first token (ms)."""
    timing = timing or TimingProfile()
    now, ttft = 0.0, {}
    for _ in range(max_steps):
        if not sched.has_work():
            return ttft
        step = sched.schedule()
        now += timing.step_ms(step.prefill_tokens, step.prefill_pairs, step.decode_seqs, step.decode_kv_tokens)
        for out in sched.complete(step):
            ttft.setdefault(out.seq, now)
        if mirror is not None:
            check_consistent(sched, mirror)
    raise AssertionError("the scheduler did not finish its work")


# ---------------------------------------------------------------- property: no leaks

BASES = [[10 + (i * 7) % 400 for i in range(40)], [20 + (i * 13) % 400 for i in range(40)]]

add_op = st.tuples(st.just("add"), st.sampled_from([0, 1, None]), st.integers(0, 40), st.integers(1, 30),
                   st.integers(1, 40), st.integers(1, 3))
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))
step_op = st.tuples(st.just("step"), st.integers(1, 6))
clear_op = st.tuples(st.just("clear"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(add_op, abort_op, step_op, clear_op), max_size=40),
       num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(4, 64), max_num_seqs=st.integers(1, 8))
def test_block_accounting_never_leaks(ops, num_blocks, block_size, budget, max_num_seqs):
    sched, mirror = make_scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, budget=budget)
    max_model_len = sched.max_model_len
    live: list[Sequence] = []
    aborted: set[Sequence] = set()
    for op in ops:
        if op[0] == "add":
            _, base, prefix_len, suffix_len, max_tokens, n = op
            prompt = (BASES[base][:prefix_len] if base is not None else []) + \
                [100 + (prefix_len * 31 + i * 17) % 300 for i in range(suffix_len)]
            prompt = prompt[: max_model_len - 1]
            for i in range(n):
                seq = make_seq(prompt, max_tokens, index=i)
                sched.add(seq)
                live.append(seq)
        elif op[0] == "abort" and live:
            seq = live[op[1] % len(live)]
            sched.abort(seq)
            aborted.add(seq)
        elif op[0] == "step":
            for _ in range(op[1]):
                if sched.has_work():
                    sched.complete(sched.schedule())
        elif op[0] == "clear":
            # Refused while blocks are in use, as vLLM refuses reset_prefix_cache.
            assert sched.pool.reset() == (sched.pool.num_in_use == 0)
        check_consistent(sched, mirror)

    run_until_idle(sched, mirror=mirror)
    pool = sched.pool
    assert pool.num_in_use == 0 and all(r == 0 for r in pool.ref_counts)
    assert len(pool.empty) + len(pool.evictable) == pool.num_blocks
    for seq in live:
        assert seq.status == FINISHED
        if seq not in aborted:
            # Whatever preemptions happened, each finished sequence got exactly its tokens.
            expected = min(seq.max_tokens, max_model_len - seq.num_prompt_tokens)
            assert seq.num_output_tokens == expected
    if any(s.num_preemptions for s in live):
        event("preempted")


# ---------------------------------------------------------------- prefix reuse

def test_shared_prefix_reports_cached_full_blocks_and_a_shorter_ttft():
    sched, mirror = make_scheduler(64, 4, budget=512)
    first = make_seq(list(range(100, 130)), max_tokens=2)  # 30 tokens: 7 full blocks
    sched.add(first)
    run_until_idle(sched, mirror=mirror)
    assert first.num_cached_tokens == 0

    shared = list(range(100, 114))  # 14 shared tokens: 3 full blocks
    second = make_seq(shared + list(range(300, 316)), max_tokens=2)
    cold = make_seq(list(range(200, 230)), max_tokens=2)  # same length, nothing shared
    sched.add(second)
    ttft_second = run_until_idle(sched, mirror=mirror)[second]
    sched.add(cold)
    ttft_cold = run_until_idle(sched, mirror=mirror)[cold]
    assert second.num_cached_tokens == 12
    assert cold.num_cached_tokens == 0
    assert ttft_second < ttft_cold

    # The same prompt again: every full block hits except that the last token is always
    # recomputed (vLLM needs its logits), so a prompt of whole blocks reuses all but one.
    again = make_seq(list(range(100, 128)), max_tokens=1)  # 28 tokens = 7 full blocks
    sched.add(again)
    run_until_idle(sched, mirror=mirror)
    assert again.num_cached_tokens == 24


def test_new_tokens_on_a_cached_prefix_pay_for_attending_to_it():
    """A prefill's cost grows with the cached context it attends to (the real engine's TTFT
    for 158 new tokens rose from 232 to 314 ms on a 512-token cached prefix), and a batch
    of prompts is charged per sequence, not as one long sequence."""
    timing = TimingProfile(step_base_ms=0, prefill_ms_per_token=1.0, prefill_ms_per_token_pair=0.01,
                           decode_ms_per_seq=0, decode_ms_per_kv_token=0)
    sched, mirror = make_scheduler(512, 16, budget=4096)
    prefix = list(range(1000, 1512))  # 32 full blocks
    sched.add(make_seq(prefix, max_tokens=1))
    run_until_idle(sched, timing, mirror)
    on_prefix = make_seq(prefix + list(range(2000, 2128)), max_tokens=1)
    alone = make_seq(list(range(3000, 3128)), max_tokens=1)
    sched.add(on_prefix)
    ttft_on_prefix = run_until_idle(sched, timing, mirror)[on_prefix]
    sched.add(alone)
    ttft_alone = run_until_idle(sched, timing, mirror)[alone]
    assert on_prefix.num_cached_tokens == 512
    assert ttft_on_prefix == pytest.approx(128 + 0.01 * 128 * (512 + 64))
    assert ttft_alone == pytest.approx(128 + 0.01 * 128 * 64)

    pair = [make_seq(list(range(4000 + 1000 * i, 4128 + 1000 * i)), max_tokens=1) for i in range(2)]
    for seq in pair:
        sched.add(seq)
    ttfts = run_until_idle(sched, timing, mirror)
    assert ttfts[pair[0]] == pytest.approx(2 * ttft_alone)  # one step, two 128-token prompts


def test_without_prefix_caching_nothing_is_reused():
    sched, mirror = make_scheduler(64, 4, budget=512, caching=False)
    for _ in range(2):
        seq = make_seq(list(range(100, 130)), max_tokens=2)
        sched.add(seq)
        run_until_idle(sched, mirror=mirror)
        assert seq.num_cached_tokens == 0
    assert not mirror.hashes


# ---------------------------------------------------------------- eviction order

def test_empty_blocks_are_used_before_any_cached_block_is_evicted():
    events = []
    pool = BlockPool(8, 4, on_event=events.append)
    blocks = pool.allocate(3)
    hashes = [11, 12, 13]
    pool.cache_full_blocks(blocks, hashes, 0, 3, list(range(12)))
    pool.free(reversed(blocks))
    assert len(pool.evictable) == 3 and len(pool.empty) == 5
    pool.allocate(5)
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert pool.lookup(hashes) == blocks


def test_eviction_is_lru_and_takes_a_sequence_suffix_before_its_prefix():
    sched, mirror = make_scheduler(8, 4, budget=64)
    older = make_seq(list(range(100, 112)), max_tokens=1)  # 3 full prompt blocks + 1 for the output
    newer = make_seq(list(range(200, 212)), max_tokens=1)
    sched.add(older)
    run_until_idle(sched, mirror=mirror)
    sched.add(newer)
    run_until_idle(sched, mirror=mirror)
    assert len(sched.pool.evictable) == 6 and len(sched.pool.empty) == 2

    pool, held = sched.pool, []

    def evict(count):
        start = len(mirror.events)
        held.extend(pool.allocate(count))
        return mirror.removed_since(start)

    assert evict(2) == []  # the two empty blocks go first
    # Then the least recently freed sequence, its last block first.
    assert evict(1) == [older.hashes[2]]
    assert evict(1) == [older.hashes[1]]
    assert evict(2) == [older.hashes[0], newer.hashes[2]]
    assert len(pool.lookup(newer.hashes)) == 2  # newer's prefix survives longest
    pool.free(held)
    check_consistent(sched, mirror)


def test_a_prefix_hit_protects_blocks_from_eviction_and_refreshes_their_recency():
    sched, mirror = make_scheduler(8, 4, budget=64)
    a = make_seq(list(range(100, 108)), max_tokens=1)  # blocks a0 a1 (+1 partial)
    b = make_seq(list(range(200, 208)), max_tokens=1)
    for seq in (a, b):
        sched.add(seq)
        run_until_idle(sched, mirror=mirror)
    # a's prefix is used again: it becomes the most recently freed.
    again = make_seq(list(range(100, 105)), max_tokens=1)
    sched.add(again)
    run_until_idle(sched, mirror=mirror)
    assert again.num_cached_tokens == 4
    before = set(sched.pool.cached)
    held = sched.pool.allocate(sched.pool.num_available - 1)
    assert before & set(sched.pool.cached) == {a.hashes[0]}
    sched.pool.free(held)
    check_consistent(sched, mirror)


def test_clear_drops_the_cache_only_when_idle():
    sched, mirror = make_scheduler(16, 4, budget=64)
    seq = make_seq(list(range(100, 120)), max_tokens=30)
    sched.add(seq)
    sched.complete(sched.schedule())
    assert not sched.pool.reset()
    run_until_idle(sched, mirror=mirror)
    assert sched.pool.cached
    assert sched.pool.reset()
    assert not sched.pool.cached and not mirror.hashes
    assert len(sched.pool.empty) == 16
    check_consistent(sched, mirror)


# ---------------------------------------------------------------- preemption

def test_preemption_recomputes_the_newest_sequence_and_keeps_its_output():
    # Alone, each sequence gets the same tokens: preemption must not change what it generates.
    prompts = [list(range(100, 108)), list(range(200, 208))]
    alone = []
    for p in prompts:
        sched, _ = make_scheduler(16, 4, budget=64)
        seq = make_seq(p, max_tokens=14)
        sched.add(seq)
        run_until_idle(sched)
        alone.append(seq.tokens)

    # Together in 9 blocks they cannot both reach 8 + 14 tokens (6 blocks each).
    sched, mirror = make_scheduler(9, 4, budget=64)
    first, second = make_seq(prompts[0], max_tokens=14), make_seq(prompts[1], max_tokens=14)
    sched.add(first)
    sched.add(second)
    preempted_at = None
    for step_no in range(200):
        if not sched.has_work():
            break
        sched.complete(sched.schedule())
        check_consistent(sched, mirror)
        if preempted_at is None and second.num_preemptions:
            preempted_at = step_no
            assert second in sched.waiting and sched.waiting[0] is second  # back at the head
            assert second.blocks == [] and second.num_computed == 0
            assert first.num_preemptions == 0  # the older one keeps running
    assert preempted_at is not None, "the tiny pool never forced a preemption"
    assert [first.tokens, second.tokens] == alone
    assert sched.pool.num_in_use == 0

"""The KV indexer against a brute-force model of each worker's prefix cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from turbine.router.hashing import block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey

BS = 2
WORKERS = [WorkerKey("a"), WorkerKey("b"), WorkerKey("c", 1)]


def engine_hash(worker: WorkerKey, prefix: tuple[int, ...]) -> int:
    # Each engine hashes its own way (per-worker salt): the index must not depend on it.
    return hash((worker, prefix)) & ((1 << 63) - 1)


class Reference:
    """Per worker: engine hash -> the full token prefix that block ends."""

    def __init__(self):
        self.blocks: dict[WorkerKey, dict[int, tuple[int, ...]]] = {}

    def stored(self, worker, parent, prefixes):
        mine = self.blocks.setdefault(worker, {})
        if parent is not None and parent not in mine:
            return
        for p in prefixes:
            mine[engine_hash(worker, p)] = p

    def matches(self, tokens) -> dict[WorkerKey, int]:
        out = {}
        for w, mine in self.blocks.items():
            held = set(mine.values())
            n = 0
            while (n + 1) * BS <= len(tokens) and tuple(tokens[:(n + 1) * BS]) in held:
                n += 1
            if n:
                out[w] = n
        return out


seqs = st.lists(st.integers(0, 2), min_size=BS, max_size=4 * BS)
ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), seqs, st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.integers(0, 50)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    st.tuples(st.just("leave"), st.sampled_from(WORKERS)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=ops, queries=st.lists(seqs, min_size=1, max_size=6))
def test_random_interleavings_match_the_reference(ops, queries):
    index, ref = KvIndexer(BS), Reference()
    for op in ops:
        kind, worker = op[0], op[1]
        if kind == "store":
            _, _, tokens, start, count = op
            nblocks = len(tokens) // BS
            start = min(start, nblocks - 1)
            end = min(nblocks, start + count)
            prefixes = [tuple(tokens[:(i + 1) * BS]) for i in range(start, end)]
            parent = engine_hash(worker, tuple(tokens[:start * BS])) if start else None
            index.apply(worker, BlockStored(block_hashes=[engine_hash(worker, p) for p in prefixes],
                                            parent_hash=parent, token_ids=list(tokens[start * BS:end * BS]),
                                            block_size=BS))
            ref.stored(worker, parent, prefixes)
        elif kind == "remove":
            held = sorted(ref.blocks.get(worker, {}))
            if held:
                victim = held[op[2] % len(held)]
                index.apply(worker, BlockRemoved(block_hashes=[victim]))
                del ref.blocks[worker][victim]
        elif kind == "clear":
            index.apply(worker, AllBlocksCleared())
            ref.blocks.pop(worker, None)
        else:
            index.remove_worker(worker)
            ref.blocks.pop(worker, None)
    for tokens in queries:
        assert index.find_matches(block_hashes(tokens, BS)) == ref.matches(tokens)
    for w in WORKERS:
        assert index.blocks_of(w) == len(set(ref.blocks.get(w, {}).values()))


def test_longest_prefix_per_worker():
    index = KvIndexer(BS)
    a, b = WORKERS[0], WORKERS[1]
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, BS)
    index.apply(a, BlockStored(block_hashes=[11, 12, 13], parent_hash=None, token_ids=tokens, block_size=BS))
    index.apply(b, BlockStored(block_hashes=[21], parent_hash=None, token_ids=tokens[:2], block_size=BS))
    assert index.find_matches(hashes) == {a: 3, b: 1}
    # A continuation stored later chains from its parent's engine hash.
    index.apply(b, BlockStored(block_hashes=[22], parent_hash=21, token_ids=tokens[2:4], block_size=BS))
    assert index.find_matches(hashes) == {a: 3, b: 2}
    # Removing a middle block ends the match there.
    index.apply(a, BlockRemoved(block_hashes=[12]))
    assert index.find_matches(hashes) == {a: 1, b: 2}
    index.remove_worker(b)
    assert index.find_matches(hashes) == {a: 1}


def test_lora_blocks_are_distinct():
    index = KvIndexer(BS)
    index.apply(WORKERS[0], BlockStored(block_hashes=[1], parent_hash=None, token_ids=[7, 7], block_size=BS),
                lora_name="adapter")
    assert index.find_matches(block_hashes([7, 7], BS)) == {}
    assert index.find_matches(block_hashes([7, 7], BS, lora_name="adapter")) == {WORKERS[0]: 1}


def test_block_size_mismatch_is_loud():
    with pytest.raises(ValueError, match="block size 4"):
        KvIndexer(BS).apply(WORKERS[0], BlockStored(block_hashes=[1], parent_hash=None, token_ids=[1, 2, 3, 4],
                                                    block_size=4))

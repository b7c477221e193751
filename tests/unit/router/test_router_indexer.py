"""The KV indexer against a brute-force model of each worker's prefix cache."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbine.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    pack_token_ids,
    unpack_token_ids,
)
from turbine.router.hashing import block_hashes, packed_block_hashes
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.runtime.codec import decode, encode
from turbine.runtime.errors import DecodeError

BS = 2
WORKERS = [WorkerKey("a"), WorkerKey("b"), WorkerKey("c", 1)]


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int = BS) -> BlockStored:
    return BlockStored.from_token_ids(block_hashes=hashes, parent_hash=parent, token_ids=token_ids,
                                      block_size=block_size)


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
            index.apply(worker, stored([engine_hash(worker, p) for p in prefixes], parent,
                                       list(tokens[start * BS:end * BS])))
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
    index.apply(a, stored([11, 12, 13], None, tokens))
    index.apply(b, stored([21], None, tokens[:2]))
    assert index.find_matches(hashes) == {a: 3, b: 1}
    # A continuation stored later chains from its parent's engine hash.
    index.apply(b, stored([22], 21, tokens[2:4]))
    assert index.find_matches(hashes) == {a: 3, b: 2}
    # Removing a middle block ends the match there.
    index.apply(a, BlockRemoved(block_hashes=[12]))
    assert index.find_matches(hashes) == {a: 1, b: 2}
    index.remove_worker(b)
    assert index.find_matches(hashes) == {a: 1}


def test_lora_blocks_are_distinct():
    index = KvIndexer(BS)
    index.apply(WORKERS[0], stored([1], None, [7, 7]), lora_name="adapter")
    assert index.find_matches(block_hashes([7, 7], BS)) == {}
    assert index.find_matches(block_hashes([7, 7], BS, lora_name="adapter")) == {WORKERS[0]: 1}


def test_block_size_mismatch_is_loud():
    with pytest.raises(ValueError, match="block size 4"):
        KvIndexer(BS).apply(WORKERS[0], stored([1], None, [1, 2, 3, 4], block_size=4))


# -- packed token ids: the wire's BlockStored.tokens and the router's hashing -------------------
def test_hashes_are_stable_across_versions():
    # Values of the hashing before token ids were packed on the wire: routing state must not change.
    assert block_hashes([1, 2, 3, 4, 5], 2) == [7557889067050924500, 13271293602710904338]
    assert block_hashes([70000, 2**32 - 1, 0, 9], 2, lora_name="ad", parent=12345) == [
        15723851513669563957, 5069019932378245989]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), bs=st.integers(1, 8),
       lora=st.sampled_from([None, "lora-a"]), parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_packed_tokens_hash_like_token_lists(tokens, bs, lora, parent):
    # The router hashes prompts (lists) and stored events (packed bytes): the same blocks, the same hashes.
    expected = block_hashes(tokens, bs, lora_name=lora, parent=parent)
    full = len(tokens) - len(tokens) % bs
    assert packed_block_hashes(pack_token_ids(tokens[:full]), bs, lora_name=lora, parent=parent) == expected
    assert packed_block_hashes(pack_token_ids(tokens), bs, lora_name=lora, parent=parent) == expected
    assert unpack_token_ids(pack_token_ids(tokens)) == tokens


def test_stored_tokens_are_packed_little_endian_u32_on_the_wire():
    event = BlockStored.from_token_ids(block_hashes=[5], parent_hash=None, token_ids=[1, 0x01020304], block_size=2)
    assert event.tokens == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert event.token_ids == [1, 0x01020304] and event.num_tokens == 2
    batch = KvEventBatch(instance_id="w", event_id=0, events=[event])
    wire = encode(batch)
    assert msgspec.msgpack.decode(wire)["events"][0]["tokens"] == event.tokens  # a msgpack bin, not an array
    assert decode(wire, KvEventBatch) == batch
    with pytest.raises(OverflowError):
        BlockStored.from_token_ids(block_hashes=[5], parent_hash=None, token_ids=[-1, 2], block_size=2)


def test_a_stored_event_of_wire_version_1_is_rejected_loudly():
    v1 = {"instance_id": "w", "event_id": 0,
          "events": [{"type": "stored", "block_hashes": [5], "parent_hash": None, "token_ids": [1, 2],
                      "block_size": 2}]}
    with pytest.raises(DecodeError, match="tokens"):
        decode(msgspec.msgpack.encode(v1), KvEventBatch)


def test_stored_tokens_of_the_wrong_length_are_rejected():
    index = KvIndexer(BS)
    for tokens in (b"\x01\x00\x00\x00", b"\x01\x00\x00\x00" * 2 + b"\x00"):
        with pytest.raises(ValueError, match="bytes of tokens"):
            index.apply(WORKERS[0], BlockStored(block_hashes=[1], parent_hash=None, tokens=tokens, block_size=BS))
    assert len(index) == 0

"""vLLM's KV events as the relay republishes them: stored blocks' token ids packed for the wire."""

from __future__ import annotations

import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

from turbine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from turbine.router.hashing import block_hashes  # noqa: E402
from turbine.router.indexer import KvIndexer, WorkerKey  # noqa: E402
from turbine.vllm.kv_events_relay import engine_hash, translate  # noqa: E402

BS = 4
TOKENS = [11, 12, 13, 14, 70_000, 49_151, 0, 7]


def vllm_stored(hashes, parent, tokens) -> object:
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                   lora_id=None, medium="GPU", lora_name=None)


def test_stored_blocks_are_relayed_with_packed_tokens_the_router_hashes_like_a_prompt():
    ours = translate(vllm_stored([b"\x01" * 32, 2], None, TOKENS))
    assert isinstance(ours, BlockStored)
    assert ours.block_hashes == [engine_hash(b"\x01" * 32), 2] and ours.parent_hash is None
    assert ours.tokens == b"".join(t.to_bytes(4, "little") for t in TOKENS) and ours.token_ids == TOKENS
    index = KvIndexer(BS)
    index.apply(WorkerKey("w"), ours)
    index.apply(WorkerKey("w"), translate(vllm_stored([3], 2, [1, 2, 3, 4])))
    assert index.find_matches(block_hashes(TOKENS + [1, 2, 3, 4], BS)) == {WorkerKey("w"): 3}


def test_removals_and_clears_are_relayed():
    assert translate(vllm_events.BlockRemoved(block_hashes=[5, b"\x02"], medium="GPU")) == BlockRemoved(
        block_hashes=[5, engine_hash(b"\x02")])
    assert translate(vllm_events.AllBlocksCleared()) == AllBlocksCleared()
